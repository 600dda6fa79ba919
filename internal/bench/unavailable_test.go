package bench

import (
	"encoding/json"
	"strings"
	"testing"

	"deltabox/internal/criu"
)

// A baseline that could not run (CRIU unusable) shows its reason where its figures
// would be, in the JSON, the markdown and the terminal table, and the mcts verdicts do
// not count it as a score mismatch.
func TestUnavailableBaselines(t *testing.T) {
	why := "CRIU is unusable here: the plain self-test: criu dump of pid 7 did not finish within 5s"
	cr := &criu.Runner{Bin: "/x/criu", Mode: criu.Unusable, Reason: "hangs", ProbeS: 10.02}
	f := &File{Bench: "latency", Machine: Machine{CRIU: cr}, Notes: []string{"criu: " + criuNote(cr)},
		Results: append([]Row{{System: SysDeltaBox, Op: "restore", WorkspaceMB: 2, P50: 1, N: 4, Commands: []string{"client.Restore"}}},
			UnavailableRows(SysCRIU, 2, why, "checkpoint", "restore")...)}
	b, _ := json.Marshal(f)
	var g File
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	if g.Machine.CRIU == nil || g.Machine.CRIU.Mode != criu.Unusable || g.Results[1].Unavailable() != why {
		t.Fatalf("round trip: %+v %+v", g.Machine.CRIU, g.Results[1])
	}
	md := Markdown([]*File{&g}, nil)
	for _, want := range []string{
		"| CRIU | unusable mode (/x/criu), self-test 10.02 s |",
		"| criu | checkpoint | unavailable: " + why + " |",
		"| criu | restore | unavailable: " + why + " |",
		"criu: unusable here, so its rows are marked unavailable (self-test 10.02 s): hangs",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
	if txt := FormatTable(g.Results); !strings.Contains(txt, "restore                2  unavailable: "+why) {
		t.Errorf("table:\n%s", txt)
	}

	m := &File{Bench: "mcts", MCTS: []MCTSRow{
		{System: MCTSDeltaBox, ThinkS: 0, TotalS: 10, StateS: 0.1, ScoresMatch: true},
		{System: MCTSCRIUCopy, ThinkS: 0, Info: map[string]any{"unavailable": why}},
	}}
	md = Markdown([]*File{m}, nil)
	if !strings.Contains(md, "| criu+copytree | 0 | unavailable: "+why+" |") {
		t.Errorf("mcts markdown:\n%s", md)
	}
	if txt := FormatMCTS(m); !strings.Contains(txt, "unavailable: "+why) {
		t.Errorf("mcts text:\n%s", txt)
	}
	for _, v := range MCTSVerdicts(m.MCTS) {
		if strings.HasPrefix(v.Target, "every system's node scores") &&
			(!v.Met || v.Measured != "1 of 1 rows; unavailable here: criu+copytree at 0 s") {
			t.Errorf("scores verdict: %+v", v)
		}
	}
}
