package session

import (
	"fmt"
	"strings"
)

// The bash session's call server, typed into an interactive `bash --norc --noprofile
// --noediting -i` as its first line (bashSetup), and its call lines (bashCall).
//
// A call's code is one $'...' word (bashQuote) assigned to __db_c, added to the history
// and eval'ed in the shell itself: variables, functions, cwd and options persist. Bash
// decodes the word as it parses the line, so a call costs no fork: the base64 encoding
// it replaced ran `$(printf %s "$b" | base64 -d)`, a subshell and a process, 30-50 ms
// a call on a 2-core VM against 0.3 ms for a python session's.
//
// After each line it reads, bash runs PROMPT_COMMAND, which prints the sentinel
// "\x1eDBX:<id>:<status>[:x]\x1e" to /dev/tty (not to stdout, which the code may have
// redirected for good with `exec >log`) and forgets the id.
//
// Ending a call, not the shell. An interactive shell exits on `exit` and, under `set
// -e`, on a failing command; an agent's code does both all the time. The session ends
// the call instead, through the one way bash has to abandon a command line and go back
// to its prompt, keeping every bit of its state: SIGINT, as ^C at a terminal.
//   - exit is a shell function: in the session's shell (BASHPID is the session's PID) it
//     works out the status as the builtin would (none: $?; N: N & 255; not a number: a
//     message and 2; two words: a message and status 1, and the code goes on, as the
//     builtin does) and calls __db_end. In a subshell, a command substitution or a
//     pipeline's part it is the builtin: `(exit 3)` exits that subshell.
//   - errexit: an ERR trap, run on the same failures as errexit (not in conditions, &&
//     and || lists, or under !), calls __db_end when `set -e` is on. errtrace (set -E)
//     lets functions inherit it, as they inherit errexit. `set -e` stays on, as any
//     option does: it ends each later call at its first failing command.
//   - __db_end notes the status in __db_x, sets aside the code's own SIGINT trap (put
//     back by PROMPT_COMMAND) and sends SIGINT to the shell, which unwinds everything
//     (functions, loops, eval, source), prints a newline to stderr (bash's, for the ^C
//     it believes it saw: the sentinel's ":x" says so and Run drops it) and returns to
//     its prompt: PROMPT_COMMAND reports __db_x.
// What still ends the shell, as in a terminal: `builtin exit`, `exec CMD` (CMD replaces
// the shell, and the session ends when it does), a kill of the shell, and `set -e` after
// the code replaced the ERR trap with its own. The call then answers with the process's
// status (Run's endedError) and the next call starts a new shell.
//
// No typed line holds a '!': history expansion is on in an interactive shell, and would
// rewrite it.

// bashSetup turns the interactive shell into a call server and prints the sentinel of
// id (the readiness check). The leading space keeps protocol lines out of history
// (HISTCONTROL=ignorespace).
func bashSetup(id string) string {
	return " " + strings.Join([]string{
		`stty -echo`, `HISTCONTROL=ignorespace`, `PS1=''`, `PS2=''`,
		`__db_pid=$BASHPID __db_x= __db_it= __db_b= __db_c=`,
		`exit() { __db_s=$?; [[ $BASHPID == "$__db_pid" ]] || builtin exit "${@:-$__db_s}"; ` +
			`if (( $# > 1 )); then builtin echo "bash: exit: too many arguments" >&2; return 1; fi; ` +
			`if (( $# )); then case ${1#[-+]} in ''|*[^0-9]*) builtin echo "bash: exit: $1: numeric argument required" >&2; __db_s=2;; ` +
			`*) __db_s=$(( ${1%%[0-9]*}10#${1#[-+]} & 255 ));; esac; fi; __db_end "$__db_s"; }`,
		`__db_end() { __db_x=$1; __db_it=$(builtin trap -p INT); builtin trap - INT; builtin kill -INT "$__db_pid"; }`,
		`builtin trap '__db_e=$?; [[ $- == *e* && $BASHPID == "$__db_pid" ]] && __db_end "$__db_e"' ERR`,
		`set -E`,
		`PROMPT_COMMAND='__db_rc=$?; [[ -z $__db_it ]] || { eval "$__db_it"; __db_it=; }; ` +
			`builtin printf "\036DBX:%s:%s%s\036" "$__db_id" "${__db_x:-$__db_rc}" "${__db_x:+:x}" >/dev/tty; __db_id= __db_x='`,
		`__db_id=` + id,
	}, "; ") + "\n"
}

// bashCall returns the lines that run code as call id: the code in $'...' pieces on lines
// short enough for the terminal's canonical-mode line buffer (4095 bytes), the id on the
// last line only (the nonce is unknown in the sandbox until the code runs).
func bashCall(code, id string) string {
	pieces := bashQuote(code, chunk)
	var b strings.Builder
	last := len(pieces) - 1
	for i, p := range pieces[:last] {
		op := "+="
		if i == 0 {
			op = "="
		}
		fmt.Fprintf(&b, " __db_b%s$'%s'\n", op, p)
	}
	prefix := ""
	if last > 0 {
		prefix = "$__db_b"
	}
	fmt.Fprintf(&b, ` __db_id=%s; __db_c=%s$'%s' __db_b=; history -s -- "$__db_c"; eval "$__db_c"`+"\n", id, prefix, pieces[last])
	return b.String()
}

// bashQuote encodes code as the bodies of $'...' words of at most width bytes each (at
// least one, maybe empty), whose concatenation bash decodes to code: printable ASCII as
// itself but for ' \ and !, newline as \n, every other byte as \xHH. NUL, which no bash
// string can hold, is dropped. The terminal then carries printable ASCII only: no byte
// is a line-discipline control character (^C, ^D, ^U, ^V, ^Z...), a UTF-8 sequence, or
// a '!' that history expansion would rewrite; an escape is never split between words.
func bashQuote(code string, width int) []string {
	const hex = "0123456789abcdef"
	var pieces []string
	var b strings.Builder
	for i := 0; i < len(code); i++ {
		c := code[i]
		var e string
		switch {
		case c == 0:
			continue
		case c == '\n':
			e = `\n`
		case c < 0x20 || c >= 0x7f || c == '\'' || c == '\\' || c == '!':
			e = string([]byte{'\\', 'x', hex[c>>4], hex[c&15]})
		default:
			e = string(c)
		}
		if b.Len()+len(e) > width {
			pieces = append(pieces, b.String())
			b.Reset()
		}
		b.WriteString(e)
	}
	return append(pieces, b.String())
}
