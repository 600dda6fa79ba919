package netproxy

import (
	"bytes"
	"encoding/binary"
	"net"
	"strings"
)

// maxPeek bounds what the proxy reads of a connection before it decides: a TLS
// ClientHello (about 2 KB with post-quantum key shares) or HTTP request headers.
const maxPeek = 16 << 10

// peekState says whether head holds what the proxy needs to read a name from it.
type peekState int

const (
	needMore peekState = iota // a TLS record or HTTP headers, not complete yet
	complete                  // the name (or its absence) is known
	opaque                    // neither TLS nor HTTP: no name to read
)

// clientName reads the name a connection's first bytes ask for: the SNI of a TLS
// ClientHello or the Host of an HTTP/1 request ("" when there is none).
func clientName(head []byte) (string, peekState) {
	if len(head) == 0 {
		return "", needMore
	}
	if head[0] == 0x16 { // TLS handshake record
		if len(head) < 5 {
			return "", needMore
		}
		n := int(binary.BigEndian.Uint16(head[3:5]))
		if len(head) < 5+n {
			if 5+n > maxPeek {
				return "", opaque
			}
			return "", needMore
		}
		return sniOf(head[5 : 5+n]), complete
	}
	if i := bytes.IndexByte(head, ' '); i > 0 && i <= 8 && isToken(head[:i]) {
		end := bytes.Index(head, []byte("\r\n\r\n"))
		if end < 0 {
			if len(head) >= maxPeek {
				return "", opaque
			}
			return "", needMore
		}
		for _, line := range strings.Split(string(head[:end]), "\r\n")[1:] {
			k, v, ok := strings.Cut(line, ":")
			if ok && strings.EqualFold(strings.TrimSpace(k), "host") {
				return hostOnly(strings.TrimSpace(v)), complete
			}
		}
		return "", complete
	}
	return "", opaque
}

func isToken(b []byte) bool {
	for _, c := range b {
		if c < 'A' || c > 'Z' {
			return false
		}
	}
	return true
}

// hostOnly strips a port from a Host header value.
func hostOnly(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		return strings.Trim(host, "[]")
	}
	return strings.Trim(h, "[]")
}

// sniOf reads the server_name extension of a ClientHello handshake message (RFC 8446
// 4.1.2, RFC 6066 3); "" when absent or malformed.
func sniOf(b []byte) string {
	// handshake: type(1)=1 len(3) version(2) random(32)
	if len(b) < 38 || b[0] != 1 {
		return ""
	}
	b = b[38:]
	skip := func(lenBytes int) bool {
		if len(b) < lenBytes {
			return false
		}
		n := 0
		for i := 0; i < lenBytes; i++ {
			n = n<<8 | int(b[i])
		}
		if len(b) < lenBytes+n {
			return false
		}
		b = b[lenBytes+n:]
		return true
	}
	if !skip(1) || !skip(2) || !skip(1) { // session id, cipher suites, compression
		return ""
	}
	if len(b) < 2 {
		return ""
	}
	ext := b[2:]
	if n := int(binary.BigEndian.Uint16(b)); n < len(ext) {
		ext = ext[:n]
	}
	for len(ext) >= 4 {
		typ, n := binary.BigEndian.Uint16(ext), int(binary.BigEndian.Uint16(ext[2:]))
		if len(ext) < 4+n {
			return ""
		}
		data := ext[4 : 4+n]
		ext = ext[4+n:]
		if typ != 0 { // server_name
			continue
		}
		// server_name_list len(2), then type(1)=0 host_name, len(2), name
		if len(data) < 5 || data[2] != 0 {
			return ""
		}
		l := int(binary.BigEndian.Uint16(data[3:]))
		if len(data) < 5+l {
			return ""
		}
		return string(data[5 : 5+l])
	}
	return ""
}
