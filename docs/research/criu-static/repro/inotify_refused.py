import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()                                   # sends the process to CRIU
fd = libc.inotify_init1(0)
wd = libc.inotify_add_watch(fd, b"/workspace", 0x100)   # IN_CREATE on /workspace (zdtm inotify00)
while True: time.sleep(1)
