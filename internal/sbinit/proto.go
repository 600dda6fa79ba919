// Package sbinit is the sandbox's init (PID 1 of its PID namespace) and the daemon's
// client for it, and NS (kernelns.go): the daemon's handle on init's IPC and UTS
// namespaces, to read and reset what the sandbox shares there.
//
// The daemon starts init by re-executing its own binary with new user, PID, mount,
// UTS, IPC, network and cgroup namespaces, inside the sandbox's cgroup (with isolation
// off, the daemon's switch for comparisons, without the user namespace). Init builds the base mount
// namespace (see package mountns), then serves requests on fd 3, one end of a
// SOCK_SEQPACKET socketpair whose other end the daemon keeps:
//
//	daemon                                   init
//	  |  start (clone NEWUSER|NEWPID|NEWNS|    |
//	  |   NEWUTS|NEWIPC|NEWNET|NEWCGROUP,      |
//	  |   into the sandbox's cgroup2 group)    |
//	  |                                        |-- mount tmpfs root, /proc, /dev, lo up,
//	  |                                        |   pivot_root (the base namespace)
//	  |<------------- {op:ready} --------------|
//	  |-- {id,op:spawn,...} + fds ------------>|   fds: stdin, stdout, stderr, state mntns
//	  |<------------- {id,pid} + pidfd --------|   always before that pid's exit event
//	  |<------------- {op:exit,pid,status} ----|   for every child init reaps
//	  |-- {id,op:signal,pid,sig,group} ------->|
//	  |<------------- {id} --------------------|
//	  |-- {id,op:killall,keep} --------------->|   SIGKILL all but init and keep (PIDs in
//	  |<------------- {id,count} --------------|   the sandbox: templates, live sessions),
//	  |                                        |   reap them all
//	  |-- {id,op:reap,keep} ------------------>|   reap just keep (children the daemon
//	  |<------------- {id,count} --------------|   killed), their exit events first
//	  |-- {id,op:mkns} ----------------------->|   a thread of init unshares a copy of the
//	  |<------------- {id} + fd ---------------|   base mount namespace (owned by the
//	  |                                        |   sandbox's user namespace): a state's
//	  |-- {id,op:cgns} ----------------------->|   a thread of init joins the v1 limit
//	  |<------------- {id} + fd ---------------|   groups and unshares a cgroup namespace
//	  |                                        |   rooted as each command's is, for
//	  |                                        |   the processes CRIU restores
//	  |-- {id,op:branch,data} + fds ---------->|   a branch init for a fast fork
//	  |<------------- {id,pid} + pidfd --------|   (branch.go)
//	  |-- {id,op:ping} ----------------------->|   liveness
//	  |<------------- {id} --------------------|
//	  |-- {id,op:keep,key,data} + fd --------->|   init keeps fd and data under key for the
//	  |<------------- {id} --------------------|   next daemon (a session's terminal)
//	  |-- {id,op:forget,key} ----------------->|
//	  |<------------- {id} --------------------|
//	  |-- {id,op:kept} ----------------------->|   everything kept, fds in keys' order
//	  |<------------- {id,keys,datas} + fds ---|
//
// Init outlives its daemon (restart.go). When the control socket closes, init goes on
// reaping, queues the exit events (at most maxBacklog), and waits on its spare socket,
// whose other end it keeps at fd spareFD. A new daemon takes that end with pidfd_getfd
// and says hello:
//
//	new daemon                               init (orphaned)
//	  |  pidfd_open(init), start time checked  |
//	  |  pidfd_getfd(init, spareFD)            |
//	  |-- {id,op:hello} ---------------------->|   the spare becomes the control socket;
//	  |<------------- {op:exit,...} ... -------|   a new spare replaces fd spareFD;
//	  |<------------- {id,count} --------------|   count: exit events dropped (backlog full)
//
// Every reply carries err when the request failed. One message is one JSON object in one
// datagram; file descriptors ride along as SCM_RIGHTS. Init handles requests in order,
// one at a time; the exit events of the processes it reaps go out before the reply to
// the request that reaped them.
package sbinit

import (
	"encoding/json"
	"fmt"

	"golang.org/x/sys/unix"
)

// Message is every message in both directions; unused fields stay empty.
type Message struct {
	ID int64  `json:"id,omitempty"`
	Op string `json:"op,omitempty"`

	// spawn
	Argv   []string `json:"argv,omitempty"`
	Env    []string `json:"env,omitempty"`
	Dir    string   `json:"dir,omitempty"`
	Setsid bool     `json:"setsid,omitempty"`
	Ctty   bool     `json:"ctty,omitempty"` // with Setsid: stdin (a pty) becomes the controlling terminal
	User   string   `json:"user,omitempty"` // run as (LookupUser's spec, in the sandbox's files); "": root

	// signal / exit / spawn reply
	Pid    int   `json:"pid,omitempty"`
	Sig    int   `json:"sig,omitempty"`
	Group  bool  `json:"group,omitempty"`
	Status int   `json:"status,omitempty"` // wait status as returned by wait4
	Count  int   `json:"count,omitempty"`
	Keep   []int `json:"keep,omitempty"` // killall: PIDs (in the sandbox) to spare; reap: the PIDs to reap

	Err string `json:"err,omitempty"`

	// keep / forget / kept (restart.go): what init keeps for the next daemon.
	Key   string   `json:"key,omitempty"`
	Data  string   `json:"data,omitempty"`
	Keys  []string `json:"keys,omitempty"`
	Datas []string `json:"datas,omitempty"`

	// fds rode along with a reply (mkns); the receiver owns them.
	fds []int
}

// maxMessage bounds one datagram (argv and env included).
const maxMessage = 1 << 20

// smallSend is what any unix socket's default send buffer carries in one datagram.
const smallSend = 64 << 10

// firstBuf is the receive buffer a reader starts with (newBuf): most messages are well
// under it. One of maxMessage per reader was 2 MiB zeroed and faulted in per sandbox
// started (its ready and its read loop, kept for the sandbox's life) and 1 MiB in each
// init: 7% of the daemon's CPU in a 64-branch fork, and the daemon's largest allocation.
const firstBuf = 16 << 10

// newBuf is a reader's receive buffer, which recv grows to the longest datagram it met.
func newBuf() *[]byte {
	b := make([]byte, firstBuf)
	return &b
}

// fit makes *buf hold the next datagram on fd: its length, peeked (MSG_PEEK|MSG_TRUNC
// gives a datagram's whole length; with no control buffer the peek installs none of its
// fds, which stay for the read), maxMessage at most (a longer one is cut there and
// fails to parse, as it always did). fd is a SOCK_SEQPACKET socket, as every init
// socket is: on a stream socket MSG_TRUNC would drop the data.
func fit(fd int, buf *[]byte) error {
	n, _, _, _, err := unix.Recvmsg(fd, nil, nil, unix.MSG_PEEK|unix.MSG_TRUNC)
	if err != nil {
		return err
	}
	if n > len(*buf) {
		*buf = make([]byte, min(n, maxMessage))
	}
	return nil
}

func send(fd int, m *Message, fds []int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > maxMessage {
		return fmt.Errorf("message of %d bytes exceeds %d: shorten argv/env (pass large input on stdin or in a file)", len(b), maxMessage)
	}
	if len(b) > smallSend {
		// A datagram longer than the socket's send buffer fails with EMSGSIZE, and a
		// unix socket's default (net.core.wmem_default, 208 KiB here) refused a
		// command whose three 100 KB arguments the kernel's exec takes. The daemon,
		// root in the host, raises its end past net.core.wmem_max for such a message
		// (SO_SNDBUFFORCE; the kernel doubles it for its own overhead). An init cannot
		// (no CAP_NET_ADMIN in the host): its replies are small.
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, maxMessage+smallSend)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	// MSG_NOSIGNAL: a daemon that died is EPIPE here, never a SIGPIPE.
	_, err = unix.SendmsgN(fd, b, oob, nil, unix.MSG_NOSIGNAL)
	return err
}

// recvFrom is recv on a socket with SO_PASSCRED, also returning the sender's PID as the
// kernel recorded it (in the receiver's PID namespace; 0 if none came).
func recvFrom(fd int, bufp *[]byte, oob []byte) (*Message, []int, int, error) {
	if err := fit(fd, bufp); err != nil {
		return nil, nil, 0, err
	}
	buf := *bufp
	n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, nil, 0, err
	}
	var fds []int
	pid := 0
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return nil, nil, 0, err
		}
		for _, cm := range msgs {
			if r, err := unix.ParseUnixRights(&cm); err == nil {
				fds = append(fds, r...)
			} else if cred, err := unix.ParseUnixCredentials(&cm); err == nil {
				pid = int(cred.Pid)
			}
		}
	}
	if n == 0 {
		closeAll(fds)
		return nil, nil, pid, fmt.Errorf("peer closed the init socket")
	}
	m := new(Message)
	if err := json.Unmarshal(buf[:n], m); err != nil {
		closeAll(fds)
		return nil, nil, pid, fmt.Errorf("bad message from peer: %w", err)
	}
	return m, fds, pid, nil
}

func recv(fd int, bufp *[]byte, oob []byte) (*Message, []int, error) {
	if err := fit(fd, bufp); err != nil {
		return nil, nil, err
	}
	buf := *bufp
	n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, nil, err
	}
	if n == 0 {
		return nil, nil, fmt.Errorf("peer closed the init socket")
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return nil, nil, err
		}
		for _, cm := range msgs {
			r, err := unix.ParseUnixRights(&cm)
			if err == nil {
				fds = append(fds, r...)
			}
		}
	}
	m := new(Message)
	if err := json.Unmarshal(buf[:n], m); err != nil {
		for _, f := range fds {
			unix.Close(f)
		}
		return nil, nil, fmt.Errorf("bad message from peer: %w", err)
	}
	return m, fds, nil
}
