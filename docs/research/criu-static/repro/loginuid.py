import os, time
r, w = os.pipe()                                   # sends the process to CRIU
open("/proc/self/loginuid", "w").write("3")        # as zdtm's loginuid
while True: time.sleep(1)
