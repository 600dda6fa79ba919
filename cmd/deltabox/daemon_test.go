package main

import (
	"strings"
	"testing"
	"time"

	"deltabox/internal/state"
)

func TestConfigFromEnv(t *testing.T) {
	env := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	cfg, err := configFromEnv(env(nil))
	if err != nil || cfg != state.DefaultConfig() {
		t.Fatalf("empty environment: %+v, %v; want the defaults", cfg, err)
	}
	cfg, err = configFromEnv(env(map[string]string{"DELTABOX_FASTPATH": "0", "DELTABOX_WARM_PROC": "1",
		"DELTABOX_NO_PREPARE": "1", "DELTABOX_WARM_MAX": "3", "DELTABOX_ANSWER_DELAY": "5ms",
		"DELTABOX_MAX_SESSIONS_PER_SANDBOX": "8", "DELTABOX_MAX_SESSIONS": "20",
		"DELTABOX_TEMPLATE_BUDGET": "512M", "DELTABOX_TEMPLATE_BUDGET_TOTAL": "2G",
		"DELTABOX_STOP_SANDBOXES": "1", "DELTABOX_DURABLE": "0",
		"DELTABOX_LAZY_RESTORE": "1", "DELTABOX_SQUASH_DEPTH": "8", "DELTABOX_EARLY_ANSWER": "0", "DELTABOX_FORK_FAST": "0"}))
	want := state.Config{FastPath: false, WarmProcesses: true, Prepare: false, WarmMax: 3, AnswerDelay: 5 * time.Millisecond,
		MaxSessionsPerSandbox: 8, MaxSessions: 20, TemplateBudgetBytes: 512 << 20, TemplateBudgetTotalBytes: 2 << 30,
		StopSandboxes: true, Durable: false, LazyRestoreMinBytes: 0, SquashDepth: 8, EarlyAnswer: false}
	if err != nil || cfg != want {
		t.Fatalf("got %+v, %v; want %+v", cfg, err, want)
	}
	for k, v := range map[string]string{"DELTABOX_FASTPATH": "off", "DELTABOX_WARM_MAX": "-1", "DELTABOX_ANSWER_DELAY": "2",
		"DELTABOX_MAX_SESSIONS_PER_SANDBOX": "0", "DELTABOX_MAX_SESSIONS": "many", "DELTABOX_TEMPLATE_BUDGET": "lots",
		"DELTABOX_TEMPLATE_BUDGET_TOTAL": "0", "DELTABOX_STOP_SANDBOXES": "yes", "DELTABOX_DURABLE": "on", "DELTABOX_LAZY_RESTORE": "lazy",
		"DELTABOX_SQUASH_DEPTH": "1", "DELTABOX_EARLY_ANSWER": "yes", "DELTABOX_FORK_FAST": "yes"} {
		if _, err := configFromEnv(env(map[string]string{k: v})); err == nil || !strings.Contains(err.Error(), k) {
			t.Errorf("%s=%s: error %v, want one naming it", k, v, err)
		}
	}
}
