import socket, threading, time
threading.Thread(target=time.sleep, args=(1e6,), daemon=True).start()   # a second thread: sends the process to CRIU
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname())
a, _ = s.accept(); s.close()
c.shutdown(socket.SHUT_WR); a.shutdown(socket.SHUT_WR)   # both halves closed: zdtm socket-tcp-close2
while True: time.sleep(1)
