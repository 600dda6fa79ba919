import socket, threading, time
threading.Thread(target=time.sleep, args=(1e6,), daemon=True).start()   # sends the process to CRIU
s = socket.socket(socket.AF_UNIX); s.bind("/workspace/d/sock"); s.listen()
while True: time.sleep(1)
