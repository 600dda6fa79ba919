package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// parseMemoryMB parses a --memory value into MiB: a number with an optional binary
// unit K, M, G or T (also written KiB, MB, Gi, ...); a bare number is MiB. "" is 0,
// the daemon's default.
func parseMemoryMB(s string) (int64, error) { return parseSizeMB("--memory", s) }

// parseSizeMB parses the size given to flag as parseMemoryMB does.
func parseSizeMB(flag, s string) (int64, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	num := strings.TrimRight(s, "KkMmGgTtIiBb")
	unit := strings.ToUpper(strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(s[len(num):], "B"), "b"), "i"))
	mult := map[string]float64{"": 1, "K": 1.0 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]
	v, err := strconv.ParseFloat(strings.TrimSpace(num), 64)
	if mult == 0 || err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, fmt.Errorf("%s %q: want a size like 512M, 2G or 1.5G", flag, s)
	}
	mb := v * mult
	if mb < 1 || mb > 1<<40 {
		return 0, fmt.Errorf("%s %q: out of range (at least 1M)", flag, s)
	}
	return int64(mb), nil
}
