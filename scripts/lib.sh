# shellcheck shell=bash
# scripts/lib.sh: small helpers shared by DeltaBox's shell scripts (sourced, never run).
#
# Conventions: every step prints one short line "[step] what happened"; a failure prints
# "[step] FAIL: what is missing" plus a "fix:" line and exits 1. Probes are recorded with
# `probe` and printed as one table by `probe_table`.

# ---- output ------------------------------------------------------------------------------

STEP=${STEP:-setup}

say() { printf '[%s] %s\n' "$STEP" "$*"; }

warn() { printf '[%s] WARN: %s\n' "$STEP" "$*" >&2; }

# die WHAT [FIX]: stop with a clear message of what is missing and how to fix it.
die() {
	printf '[%s] FAIL: %s\n' "$STEP" "$1" >&2
	if [[ -n ${2:-} ]]; then printf '[%s]   fix: %s\n' "$STEP" "$2" >&2; fi
	exit 1
}

# now_ms: wall clock in milliseconds (for "took N s" lines).
now_ms() { date +%s%3N; }

# secs_since START_MS: elapsed seconds with one decimal.
secs_since() {
	local d=$(($(now_ms) - $1))
	printf '%d.%d' $((d / 1000)) $((d % 1000 / 100))
}

# ---- probe table -------------------------------------------------------------------------

PROBE_NAMES=()
PROBE_STATES=()
PROBE_DETAILS=()
PROBES_FAILED=0

# probe NAME ok|MISSING|FAIL|warn DETAIL: record one probe result for the summary table.
probe() {
	PROBE_NAMES+=("$1")
	PROBE_STATES+=("$2")
	PROBE_DETAILS+=("${3:-}")
	case $2 in ok | warn) ;; *) PROBES_FAILED=$((PROBES_FAILED + 1)) ;; esac
}

probe_table() {
	local i
	printf '%-26s %-8s %s\n' PROBE STATE DETAIL
	for i in "${!PROBE_NAMES[@]}"; do
		printf '%-26s %-8s %s\n' "${PROBE_NAMES[$i]}" "${PROBE_STATES[$i]}" "${PROBE_DETAILS[$i]}"
	done
}

# ---- Debian packages ---------------------------------------------------------------------

# pkgs_missing PKG...: print the packages that are not installed, one per line.
pkgs_missing() {
	local installed
	# dpkg-query exits 1 when it knows none of some names: only its output matters.
	installed=$({ dpkg-query -W -f='${Package} ${db:Status-Status}\n' "$@" 2>/dev/null || true; } |
		awk '$2 == "installed" { print $1 }')
	local p
	for p in "$@"; do
		grep -qx -- "$p" <<<"$installed" || echo "$p"
	done
}

# ---- apt sources -------------------------------------------------------------------------

# apt_source_entries: every enabled apt source entry configured on this host, one per
# (type, URI, suite), as TAB-separated "type uri suite components signed-by". Reads the
# deb822 files (*.sources) and the one-line files (sources.list, *.list). Mirror hosts are
# never hard-coded by DeltaBox: callers take them from here at run time.
apt_source_entries() {
	local d=/etc/apt
	local -a deb822=() oneline=()
	local f
	for f in "$d"/sources.list.d/*.sources; do [[ -f $f ]] && deb822+=("$f"); done
	for f in "$d"/sources.list "$d"/sources.list.d/*.list; do [[ -f $f ]] && oneline+=("$f"); done
	if ((${#deb822[@]})); then
		awk '
		function flush(  nt, nu, ns, i, j, k, T, U, S) {
			if (types != "" && uris != "" && suites != "" && enabled != "no") {
				nt = split(types, T, /[ \t]+/); nu = split(uris, U, /[ \t]+/); ns = split(suites, S, /[ \t]+/)
				for (i = 1; i <= nt; i++) for (j = 1; j <= nu; j++) for (k = 1; k <= ns; k++)
					if (T[i] != "" && U[j] != "" && S[k] != "")
						print T[i] "\t" U[j] "\t" S[k] "\t" comps "\t" signed
			}
			types = uris = suites = comps = signed = enabled = ""
		}
		FNR == 1 && NR > 1 { flush() }
		/^[ \t]*#/ { next }
		/^[ \t]*$/ { flush(); next }
		/^[ \t]/ { next }   # continuation line (e.g. an inline key block): ignored
		{
			key = tolower($0); sub(/:.*/, "", key)
			val = $0; sub(/^[^:]*:[ \t]*/, "", val); sub(/[ \t]+$/, "", val)
			if (key == "types") types = val
			else if (key == "uris") uris = val
			else if (key == "suites") suites = val
			else if (key == "components") comps = val
			else if (key == "signed-by") signed = val
			else if (key == "enabled") enabled = tolower(val)
		}
		END { flush() }' "${deb822[@]}"
	fi
	if ((${#oneline[@]})); then
		awk '
		/^[ \t]*(deb|deb-src)[ \t]/ {
			type = $1; i = 2; signed = ""
			if ($2 ~ /^\[/) {
				opts = ""
				while (i <= NF) { opts = opts " " $i; if ($i ~ /\]$/) { i++; break }; i++ }
				if (match(opts, /signed-by=[^] ]+/)) signed = substr(opts, RSTART + 10, RLENGTH - 10)
			}
			comps = ""
			for (j = i + 2; j <= NF; j++) comps = comps (comps == "" ? "" : " ") $j
			print type "\t" $i "\t" $(i + 1) "\t" comps "\t" signed
		}' "${oneline[@]}"
	fi
}

# apt_entry_for TYPE SUITE: the first configured entry of that type serving exactly that
# suite, as "uri<TAB>signed-by". Fails if there is none. (awk reads all its input: an early
# exit would SIGPIPE the writer and fail the pipeline under pipefail.)
apt_entry_for() {
	apt_source_entries | awk -F'\t' -v t="$1" -v s="$2" '
		!found && $1 == t && $3 == s { print $2 "\t" $5; found = 1 }
		END { exit !found }'
}
