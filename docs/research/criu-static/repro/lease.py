import os, fcntl, time
r, w = os.pipe()                                  # a pipe: the fast path sends the process to CRIU
fd = os.open("/workspace/leased", os.O_RDONLY | os.O_CREAT, 0o666)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)  # a read lease, as zdtm's file_lease00
while True: time.sleep(1)
