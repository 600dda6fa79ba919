package main

import "testing"

func TestParseMemoryMB(t *testing.T) {
	for in, want := range map[string]int64{
		"": 0, "512": 512, "512M": 512, "512MiB": 512, "512mb": 512, "2G": 2048, "2g": 2048,
		"2Gi": 2048, "1.5G": 1536, "1T": 1 << 20, "2048K": 2, " 3G ": 3072,
	} {
		got, err := parseMemoryMB(in)
		if err != nil || got != want {
			t.Errorf("parseMemoryMB(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"x", "2X", "-1G", "0", "100K", "G", "1e30G", "NaN"} {
		if got, err := parseMemoryMB(in); err == nil {
			t.Errorf("parseMemoryMB(%q) = %d, want an error", in, got)
		}
	}
}
