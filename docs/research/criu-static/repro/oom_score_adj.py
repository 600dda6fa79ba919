import os, time
r, w = os.pipe()                                   # sends the process to CRIU
open("/proc/self/oom_score_adj", "w").write("400")
while True: time.sleep(1)
