package netproxy

import (
	"fmt"
	"net/netip"
	"strings"
)

// Policy is a sandbox's egress rules: a destination is allowed when it matches an
// entry of Allow and none of Deny (deny wins). An entry is a domain ("pypi.org"), a
// wildcard ("*.github.com": the subdomains, not the apex), "*" (everything), an IP
// address or a CIDR ("10.0.0.0/8").
type Policy struct {
	allow, deny rules
}

type rules struct {
	all      bool
	names    map[string]bool // exact names
	suffixes []string        // ".github.com" for "*.github.com"
	nets     []netip.Prefix
}

// ParsePolicy checks and compiles allow and deny lists. An empty allow list is an
// error: it would allow nothing, which is what leaving the network option out does.
func ParsePolicy(allow, deny []string, hasModel bool) (*Policy, error) {
	if len(allow) == 0 && !hasModel {
		return nil, fmt.Errorf("network: allow_out is empty, so nothing would be reachable: list the domains and CIDRs to allow (\"*\" for everything), or leave \"network\" out for no network")
	}
	p := &Policy{}
	var err error
	if p.allow, err = parseRules("allow_out", allow); err != nil {
		return nil, err
	}
	if p.deny, err = parseRules("deny_out", deny); err != nil {
		return nil, err
	}
	return p, nil
}

func parseRules(what string, list []string) (rules, error) {
	r := rules{names: map[string]bool{}}
	for _, e := range list {
		s := strings.ToLower(strings.TrimSuffix(strings.TrimSpace(e), "."))
		switch {
		case strings.TrimSpace(e) == "*":
			r.all = true
		case strings.Contains(s, "/"):
			pfx, err := netip.ParsePrefix(s)
			if err != nil {
				return r, fmt.Errorf("network: %s entry %q: not a CIDR (e.g. 10.0.0.0/8): %v", what, e, err)
			}
			r.nets = append(r.nets, pfx.Masked())
		default:
			if a, err := netip.ParseAddr(s); err == nil {
				r.nets = append(r.nets, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
				continue
			}
			name, wild := strings.CutPrefix(s, "*.")
			if !validName(name) {
				return r, fmt.Errorf("network: %s entry %q: want a domain (example.com), a wildcard (*.example.com), \"*\", an IP or a CIDR", what, e)
			}
			if wild {
				r.suffixes = append(r.suffixes, "."+name)
			} else {
				r.names[name] = true
			}
		}
	}
	return r, nil
}

func validName(s string) bool {
	if s == "" || len(s) > 253 || strings.HasPrefix(s, ".") || strings.Contains(s, "..") {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return false
		}
	}
	return true
}

func (r *rules) name(n string) bool {
	if r.all || r.names[n] {
		return true
	}
	for _, s := range r.suffixes {
		if strings.HasSuffix(n, s) {
			return true
		}
	}
	return false
}

func (r *rules) addr(a netip.Addr) bool {
	if r.all {
		return true
	}
	a = a.Unmap()
	for _, p := range r.nets {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// normName lowercases a name and strips its trailing dot.
func normName(n string) string { return strings.ToLower(strings.TrimSuffix(n, ".")) }

// AllowsName says whether the domain rules allow name (a CIDR never does).
func (p *Policy) AllowsName(name string) bool {
	name = normName(name)
	return validName(name) && p.allow.name(name) && !p.deny.name(name)
}

// DeniesName says whether deny_out names name.
func (p *Policy) DeniesName(name string) bool { return p.deny.name(normName(name)) }

// AllowsAddr says whether the CIDR rules (or "*") allow a.
func (p *Policy) AllowsAddr(a netip.Addr) bool { return p.allow.addr(a) && !p.deny.addr(a) }

// DeniesAddr says whether deny_out's CIDRs (or "*") name a.
func (p *Policy) DeniesAddr(a netip.Addr) bool { return p.deny.addr(a) }
