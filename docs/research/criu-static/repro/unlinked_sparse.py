import os, time
r, w = os.pipe()                                   # sends the process to CRIU
fd = os.open("/workspace/sparse", os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"x", 0); os.pwrite(fd, b"y", 1 << 20)   # data, a 1 MiB hole, data
os.unlink("/workspace/sparse")                     # held open, no name (zdtm ghost_holes00)
while True:
    st = os.fstat(fd)
    open("/workspace/holes", "w").write("size %d blocks %d first hole at %d\n" % (st.st_size, st.st_blocks, os.lseek(fd, 0, os.SEEK_HOLE)))
    time.sleep(0.3)
