import os, socket, time
os.makedirs("/workspace/d", exist_ok=True)
a = socket.socket(socket.AF_UNIX); a.bind("/workspace/d/sock"); a.listen()
os.rename("/workspace/d/sock", "/workspace/d/tmp")      # a's name moves away
b = socket.socket(socket.AF_UNIX); b.bind("/workspace/d/sock"); b.listen()
os.rename("/workspace/d/tmp", "/workspace/d/sock")      # and back over b's: b's path now names a's inode
while True: time.sleep(1)
