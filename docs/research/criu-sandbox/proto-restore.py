# Prototype of the durable restore, before internal/durable existed (2026-12-04):
# python3 proto-restore.py NSPID DUMPDIR VICTIMPID [CRIU]: opens the namespaces of
# NSPID (a process of the sandbox), a new pty in the sandbox devpts, kills VICTIMPID
# (0: none), and runs `criu restore` (SETNS=1: from the sandbox PID namespace,
# through unshare --mount-proc, which makes the restored task the sandbox init child).
# The dump side was: criu dump -t PID --leave-running --external pid[INO]:pidns
#   --external net[INO]:netns --external mnt[] --external tty[RDEV:DEV] (CRIU_FAULT=130).
import os, sys, subprocess, fcntl, termios, time, struct
P=int(sys.argv[1]); D=sys.argv[2]; MNTP=int(sys.argv[3]); crit=sys.argv[4] if len(sys.argv)>4 else '/tmp/criu-patched'
nsdir=f'/proc/{P}/ns'
pidns=os.open(f'{nsdir}/pid', os.O_RDONLY)
# new pty in the sandbox's devpts
ptmx=os.open(f'/proc/{P}/root/dev/pts/ptmx', os.O_RDWR|os.O_NOCTTY)
fcntl.ioctl(ptmx, 0x40045431, struct.pack('i',0))
TIOCGPTPEER=0x5441
slave=fcntl.ioctl(ptmx, TIOCGPTPEER, os.O_RDWR|os.O_NOCTTY)
base=int(open(f'/proc/{P}/uid_map').read().split()[1]); os.fchown(slave, base, base+5)
nsfds={n: os.open(f'/proc/{P}/ns/{n}', os.O_RDONLY) for n in ['user','ipc','uts','mnt','net']}
if MNTP: os.kill(MNTP,9)
while MNTP and os.path.exists(f'/proc/{MNTP}'):
    time.sleep(0.005)
print("tty", os.ttyname(slave) if False else slave)
argv=(['unshare','--mount-proc','--propagation','private'] if os.environ.get('SETNS') else [])+[crit,'restore','-D',D,'-v4','-o','restore.log','-d',
  '--inherit-fd',f'fd[{pidns}]:pidns','--inherit-fd',f'fd[{slave}]:tty[8800:35]',
  '--ext-mount-map','auto']
for n in ['user','ipc','uts','mnt','net']:
    argv+=['--join-ns',f'{n}:/proc/self/fd/{nsfds[n]}']
t=time.time()
import ctypes
if os.environ.get('SETNS'): assert ctypes.CDLL(None,use_errno=True).setns(pidns, 0x20000000)==0
r=subprocess.run(argv, env=dict(os.environ, CRIU_FAULT='130'), pass_fds=[pidns,slave]+list(nsfds.values()), timeout=30)
print('rc',r.returncode,'t',time.time()-t)
os.close(slave)
import glob
for st in glob.glob('/proc/[0-9]*/status'):
    try: txt=open(st).read()
    except: continue
    if 'NSpid:' in txt and txt.split('NSpid:')[1].split('\n')[0].split()[-1]=='15' and 'python3' in txt: print([l for l in txt.split('\n') if l.startswith(('PPid','NSpid'))])
# talk
import base64
os.write(ptmx,b'C'+base64.b64encode(b'print(os.getpid(), x[0:10], len(x))')+b'\nRid1\n')
time.sleep(0.5)
print(os.read(ptmx,4096))
