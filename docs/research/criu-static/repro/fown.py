import os, fcntl, time
r, w = os.pipe()                                  # a pipe: the fast path sends the process to CRIU
fcntl.fcntl(r, fcntl.F_SETOWN, os.getpid())       # an fd owner (F_SETOWN), as zdtm's file_fown
while True: time.sleep(1)
