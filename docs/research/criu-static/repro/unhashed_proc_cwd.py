import os, signal, time
r, w = os.pipe()                                   # sends the process to CRIU
pid = os.fork()
if pid == 0:
    signal.pause(); os._exit(0)
os.chdir("/proc/%d" % pid)                         # cwd in a child's /proc directory (zdtm unhashed_proc)
os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)   # the child is gone: the cwd is an unhashed /proc entry
while True: time.sleep(1)
