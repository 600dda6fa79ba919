import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()                                   # sends the process to CRIU
ctx = ctypes.c_ulong(0)
assert libc.syscall(206, 16, ctypes.byref(ctx)) == 0   # io_setup: maps an AIO ring, /[aio] (zdtm aio00)
while True: time.sleep(1)
