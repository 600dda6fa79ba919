import os, signal, time
pid = os.fork()                                    # a child: sends the tree to CRIU
if pid == 0:
    while True: time.sleep(1)
os.kill(pid, signal.SIGTSTP)                       # stopped by SIGTSTP, as zdtm's stopped03
while True:
    r = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT | os.WNOHANG)
    open("/workspace/stop", "w").write("stop signal %s\n" % (r.si_status if r else None))
    time.sleep(0.3)
