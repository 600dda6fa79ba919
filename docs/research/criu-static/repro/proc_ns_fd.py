import os, time
r, w = os.pipe()                                  # a pipe: the fast path sends the process to CRIU
ns = os.open("/proc/self/ns/net", os.O_RDONLY)    # an fd on its own net namespace, as zdtm's proc-self
while True: time.sleep(1)
