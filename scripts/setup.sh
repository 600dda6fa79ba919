#!/usr/bin/env bash
# scripts/setup.sh: prepare this machine for DeltaBox. Idempotent; run as root.
#
#   scripts/setup.sh          install/create what is missing, then print the probe table
#   scripts/setup.sh --check  only probe and print what is missing (exit 1 if anything is)
#
# Environment: DELTABOX_ROOT (state dir, default /var/lib/deltabox),
#              DELTABOX_STORE_IMAGE (loop image, default /var/lib/deltabox.img),
#              DELTABOX_STORE_SIZE (sparse image size, default 64G).
#
# Every step prints one line of what it did or that it was already done. A re-run on a
# machine that is set up only probes, and takes about a second.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
. "$SCRIPT_DIR/lib.sh"

MODE=install
case ${1:-} in
'') ;;
--check) MODE=check ;;
-h | --help)
	sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
	exit 0
	;;
*)
	echo "usage: $0 [--check]" >&2
	exit 2
	;;
esac

ROOT=${DELTABOX_ROOT:-/var/lib/deltabox}
STORE_IMAGE=${DELTABOX_STORE_IMAGE:-/var/lib/deltabox.img}
STORE_SIZE=${DELTABOX_STORE_SIZE:-64G}

SUITE=bookworm # the host's and the default image's Debian release

CRIU_VERSION=4.1.1
CRIU_DEB_VERSION=4.1.1-1
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
CRIU_PREFIX=/opt/deltabox/criu
CRIU_BIN=$CRIU_PREFIX/sbin/criu # the Go code looks here first, then on PATH
CRIU_SRC_DIR=/var/cache/deltabox/criu-src
CRIU_TARBALL=$CRIU_SRC_DIR/criu_${CRIU_VERSION}.orig.tar.xz
TRIXIE_SRC_LIST=/etc/apt/sources.list.d/deltabox-trixie-src.sources
# DeltaBox's patches to CRIU (applied in name order): 0001 lets a restore join the
# sandbox's namespaces (internal/durable), 0002 faults restored pages in before reading
# them (a restore 2x faster here), 0003 lets a process CRIU restored be dumped again (its
# user namespace check opens the namespaces before it drops privileges), 0004 restores a
# background job as the leader of a session of its own (CRIU_SHELL_JOB_SETSID=1), 0005
# dumps TCP and UDP sockets on Linux 6.16+ (which refuses SO_PASSCRED on them), 0006
# restores sockets into a user namespace (SO_SNDBUFFORCE needs host root), 0007 lets
# tasks restored into a user namespace have lazy pages (/dev/userfaultfd). CRIU
# keeps what it probed of the kernel in RUNDIR/criu.kdat, only on a tmpfs: /run is not one on this machine kind, so every CRIU
# run probed again (50-100 ms each); RUNDIR is a root-only directory on /dev/shm instead,
# which internal/criu makes (it is gone after a reboot). The installed build is stamped
# with the version and a digest of the patches and RUNDIR ($CRIU_PREFIX/VERSION), so a
# change rebuilds it.
CRIU_PATCHES=("$SCRIPT_DIR"/criu/*.patch)
CRIU_KDAT_DIR=/dev/shm/deltabox-criu # internal/criu/criu.go:KdatDir
CRIU_STAMP="$CRIU_VERSION+deltabox.$({ cat "${CRIU_PATCHES[@]}"; echo "RUNDIR=$CRIU_KDAT_DIR"; } | sha256sum | cut -c1-12)"

# Go is preinstalled on this machine kind at /usr/local/go; make it visible to this script.
PATH=$PATH:/usr/local/go/bin

# Step 1 packages. Runtime tools: xfsprogs (mkfs.xfs/xfs_info for the reflink store), uidmap
# (newuidmap/newgidmap: a user namespace mapping root to 100000-165535 needs them), mmdebstrap
# (default image), iproute2, util-linux/mount (unshare, nsenter, losetup, findmnt),
# e2fsprogs (filefrag, to see shared extents), python3, git, xz-utils.
# The rest is exactly what `make criu` of CRIU 4.1.1 needs with bookworm's -dev packages
# (found by building): protoc-c and libprotobuf-c-dev for the image protos, libprotobuf-dev
# only for google/protobuf/descriptor.proto, libnl-3, libcap, libnet, uuid (all linked),
# libbsd (setproctitle), libnftables (network lock without an iptables binary: CRIU's default
# lock method is iptables, which is not installed, so callers pass --network-lock nftables or
# skip). Not needed for
# the binary alone: protobuf-compiler and python3-protobuf (crit/pycriu), libaio-dev (tests),
# libnl-route-3-dev, asciidoc/xmlto (docs); GnuTLS is switched off (NO_GNUTLS=1: DeltaBox
# never uses CRIU's TLS page server).
RUNTIME_PKGS=(xfsprogs uidmap mmdebstrap iproute2 util-linux mount e2fsprogs python3 git xz-utils)
CRIU_BUILD_PKGS=(gcc make patch libc6-dev pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev
	libnl-3-dev libcap-dev libnet1-dev uuid-dev libbsd-dev libnftables-dev)
# Checks: mypy, which scripts/test.sh runs on the Python client (--strict), examples/ and
# workload/ (Debian's: bookworm has 1.0.1, which checks for Python 3.9); chromium, in which
# tests/e2e renders the daemon's tree page (GET /v1/tree/page) headless.
CHECK_PKGS=(mypy chromium)
# Bench baselines: `deltabox bench exec` times `podman exec` beside DeltaBox's calls; runc
# because crun refuses these VMs' hybrid cgroup layout.
BENCH_PKGS=(podman runc)
ALL_PKGS=("${RUNTIME_PKGS[@]}" "${CRIU_BUILD_PKGS[@]}" "${CHECK_PKGS[@]}" "${BENCH_PKGS[@]}")

T0=$(now_ms)

[[ $EUID -eq 0 ]] || { STEP=setup die "must run as root" "sudo $0 $*"; }

# One setup at a time: two concurrent runs would race on apt, the store mount and the image.
exec 9>/run/lock/deltabox-setup.lock
flock -n 9 || { STEP=setup die "another scripts/setup.sh is running" "wait for it to finish"; }

# ==== Step 1: Debian packages ==============================================================
# Only when something is missing (a re-run must not touch apt). apt-get update only when the
# package lists cannot serve the install: no lists yet, a package without a candidate, or a
# failed download (stale lists).
step_packages() {
	STEP=pkgs
	local missing
	mapfile -t missing < <(pkgs_missing "${ALL_PKGS[@]}")
	if ((${#missing[@]} == 0)); then
		say "all ${#ALL_PKGS[@]} packages already installed"
		probe "debian packages" ok "${#ALL_PKGS[@]} installed"
		return
	fi
	if [[ $MODE == check ]]; then
		say "missing: ${missing[*]}"
		probe "debian packages" MISSING "${missing[*]}"
		return
	fi
	local need_update=0 p
	compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null || need_update=1
	if ((!need_update)); then
		for p in "${missing[@]}"; do
			if [[ $(apt-cache policy "$p" 2>/dev/null) != *"Candidate: "[!\(]* ]]; then
				need_update=1
				break
			fi
		done
	fi
	local log=/var/cache/deltabox/apt.log t
	t=$(now_ms)
	mkdir -p /var/cache/deltabox
	if ((need_update)); then
		apt-get update -qq >"$log" 2>&1 || die "apt-get update failed (see $log)" \
			"check the apt sources in /etc/apt/sources.list.d and the network"
	fi
	local install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
	if ! "${install[@]}" "${missing[@]}" >>"$log" 2>&1; then
		apt-get update -qq >>"$log" 2>&1 || true
		"${install[@]}" "${missing[@]}" >>"$log" 2>&1 || die "apt-get install failed for: ${missing[*]} (see $log)" \
			"apt-get update && apt-get install --no-install-recommends ${missing[*]}"
	fi
	say "installed ${#missing[@]} packages in $(secs_since "$t") s: ${missing[*]}"
	probe "debian packages" ok "${#ALL_PKGS[@]} installed"
}

# ==== Step 2: CRIU =========================================================================
# Debian bookworm's criu 3.17 fails `criu check` on this kernel (vDSO layout), so DeltaBox
# builds CRIU 4.1.1 from Debian trixie's source tarball into its own prefix. Only the criu
# binary is built (`make criu`, ~21 s on 2 cores, no docs). Nothing is exported globally: the Go daemon
# looks for /opt/deltabox/criu/sbin/criu, then PATH.

# criu_passes BIN: true when `BIN check` says "Looks good.".
criu_passes() {
	local out
	[[ -x $1 ]] && out=$("$1" check 2>&1) && [[ $out == *"Looks good."* ]]
}

# find_good_criu: print $CRIU_BIN if it is this script's build (stamp: version and
# patches) and `criu check` passes. A criu on PATH does not do: it lacks the patches.
find_good_criu() {
	[[ -f $CRIU_PREFIX/VERSION && $(cat "$CRIU_PREFIX/VERSION") == "$CRIU_STAMP" ]] || return 1
	criu_passes "$CRIU_BIN" && echo "$CRIU_BIN"
}

# ensure_trixie_src: a deb-src entry for trixie, same mirror and key as the host's bookworm
# entry (read at run time, never hard-coded), in a file of its own.
ensure_trixie_src() {
	local entry uri signed want
	entry=$(apt_entry_for deb "$SUITE") || die "no apt 'deb' entry for $SUITE found under /etc/apt" \
		"configure the Debian archive for $SUITE in /etc/apt/sources.list.d/debian.sources"
	uri=${entry%%$'\t'*}
	signed=${entry#*$'\t'}
	want="# Added by DeltaBox scripts/setup.sh: source of CRIU $CRIU_VERSION (bookworm's criu fails criu check here).
Types: deb-src
URIs: $uri
Suites: trixie
Components: main"
	[[ -n $signed ]] && want+=$'\n'"Signed-By: $signed"
	if [[ ! -f $TRIXIE_SRC_LIST ]] || [[ $(cat "$TRIXIE_SRC_LIST") != "$want" ]]; then
		printf '%s\n' "$want" >"$TRIXIE_SRC_LIST"
	fi
	# Refresh only this one source list; the host's other lists stay as they are.
	apt-get update -qq -o Dir::Etc::sourcelist=- -o Dir::Etc::sourceparts=- \
		-o Dir::Etc::SourceList="$TRIXIE_SRC_LIST" -o APT::Get::List-Cleanup=0 \
		>>"$CRIU_SRC_DIR/apt.log" 2>&1 || die "apt-get update for $TRIXIE_SRC_LIST failed (see $CRIU_SRC_DIR/apt.log)" \
		"check that the mirror in $TRIXIE_SRC_LIST serves trixie sources"
}

tarball_ok() {
	[[ -f $CRIU_TARBALL ]] && [[ $(sha256sum "$CRIU_TARBALL" | cut -d' ' -f1) == "$CRIU_SHA256" ]]
}

step_criu() {
	STEP=criu
	local good ver
	if good=$(find_good_criu); then
		ver=$("$good" --version 2>/dev/null || true)
		say "criu check passes: $good (${ver%%$'\n'*})"
		probe "criu check" ok "$good"
		probe_uffd "$good"
		return
	fi
	if [[ $MODE == check ]]; then
		say "no criu $CRIU_STAMP at $CRIU_BIN that passes 'criu check'"
		probe "criu check" MISSING "no working criu $CRIU_STAMP; setup.sh builds $CRIU_VERSION with scripts/criu/*.patch into $CRIU_PREFIX"
		return
	fi
	mkdir -p "$CRIU_SRC_DIR"
	local t
	t=$(now_ms)
	if tarball_ok; then
		say "source tarball cached: $CRIU_TARBALL"
	else
		ensure_trixie_src
		# The mirror serves the orig tarball but not the .dsc, so apt exits non-zero: its exit
		# code is ignored and the tarball is checked by name and sha256 instead.
		(cd "$CRIU_SRC_DIR" && apt-get source -q --download-only "criu=$CRIU_DEB_VERSION") \
			>>"$CRIU_SRC_DIR/apt.log" 2>&1 || true
		[[ -f $CRIU_TARBALL ]] || die "apt-get source did not fetch $(basename "$CRIU_TARBALL") (see $CRIU_SRC_DIR/apt.log)" \
			"check $TRIXIE_SRC_LIST and that trixie has criu $CRIU_DEB_VERSION (apt-cache showsrc criu)"
		tarball_ok || die "$CRIU_TARBALL has the wrong sha256 (want $CRIU_SHA256)" \
			"rm $CRIU_TARBALL and re-run"
		say "downloaded $(basename "$CRIU_TARBALL") (sha256 ok)"
	fi
	local build
	rm -rf /var/cache/deltabox/criu-build.* # left by an interrupted or failed build
	build=$(mktemp -d /var/cache/deltabox/criu-build.XXXXXX)
	tar -xJf "$CRIU_TARBALL" -C "$build"
	local src="$build/criu-$CRIU_VERSION" log="$CRIU_SRC_DIR/build.log" p
	for p in "${CRIU_PATCHES[@]}"; do
		patch -d "$src" -p1 --quiet <"$p" >"$log" 2>&1 || {
			cat "$log" >&2
			die "patch $(basename "$p") does not apply to criu $CRIU_VERSION" "fix the patch in scripts/criu/"
		}
	done
	if ! make -C "$src" -j2 criu NO_GNUTLS=1 RUNDIR="$CRIU_KDAT_DIR" >"$log" 2>&1; then
		tail -n 15 "$log" >&2
		die "building criu $CRIU_VERSION failed (full log: $log)" \
			"install the -dev package the log names, then re-run"
	fi
	install -D -m 0755 "$src/criu/criu" "$CRIU_BIN.new"
	mv -f "$CRIU_BIN.new" "$CRIU_BIN"
	printf '%s\n' "$CRIU_STAMP" >"$CRIU_PREFIX/VERSION"
	rm -rf "$build"
	criu_passes "$CRIU_BIN" || {
		"$CRIU_BIN" check >&2 || true
		die "$CRIU_BIN was built but 'criu check' fails (output above)" "see the kernel features it names"
	}
	say "built criu $CRIU_STAMP in $(secs_since "$t") s: $CRIU_BIN (criu check: Looks good.)"
	probe "criu check" ok "$CRIU_BIN"
	probe_uffd "$CRIU_BIN"
}

# Lazy restore (the durable path's fast restore) needs userfaultfd with non-cooperative events.
probe_uffd() {
	local out
	if out=$("$1" check --feature uffd-noncoop 2>&1); then
		say "criu check --feature uffd-noncoop: ${out##*$'\n'}"
		probe "criu uffd-noncoop" ok "${out##*$'\n'}"
	else
		say "criu check --feature uffd-noncoop failed: ${out##*$'\n'}"
		probe "criu uffd-noncoop" FAIL "${out##*$'\n'} (lazy pages unavailable)"
	fi
}

# ==== Step 3: the store and kernel features ================================================
# All layers and images live on one reflink filesystem so overlay copy-up is a block-level
# CoW (XFS reflink=1: first write to a 1 GiB lower file copies up in 3 ms). The root disk
# here is ext4, so a sparse XFS image is loop-mounted at the state dir. prjquota on that
# mount would let the daemon cap each sandbox's upper layer with XFS project quotas, but this
# machine kind's kernel is built without CONFIG_XFS_QUOTA ("XFS: quota support not available
# in this kernel", mount fails): there the store is mounted without it and the probe warns.

# xfs_quota_in_kernel: 0 if the kernel has XFS quota support, 1 if not, 2 if unknown.
xfs_quota_in_kernel() {
	[[ -r /proc/config.gz ]] || return 2
	local cfg
	cfg=$(zcat /proc/config.gz 2>/dev/null) || return 2
	[[ $cfg == *$'\n'CONFIG_XFS_QUOTA=y* ]]
}

# mount_store: loop-mount the image at the state dir, nosuid and nodev (a sandbox's files keep
# their ids inside on the store: its setuid-root files are host root's; internal/store/nosuid.go),
# with prjquota when the kernel can.
mount_store() {
	local err
	if err=$(mount -o loop,nosuid,nodev,prjquota "$STORE_IMAGE" "$ROOT" 2>&1); then
		STORE_MOUNT_NOTE="-o loop,nosuid,nodev,prjquota"
		return 0
	fi
	if err=$(mount -o loop,nosuid,nodev "$STORE_IMAGE" "$ROOT" 2>&1); then
		STORE_MOUNT_NOTE="-o loop,nosuid,nodev (kernel refused prjquota: no XFS quota support)"
		return 0
	fi
	printf '%s\n' "$err" >&2
	return 1
}

# reflink_works DIR: cp --reflink=always succeeds inside DIR.
reflink_works() {
	local d
	d=$(mktemp -d "$1/.reflink-probe.XXXXXX") || return 1
	echo probe >"$d/a"
	local rc=0
	cp --reflink=always "$d/a" "$d/b" 2>/dev/null || rc=1
	rm -rf "$d"
	return $rc
}

store_fstype() { stat -f -c %T "$ROOT"; }

# store_usable: the state dir is on a filesystem DeltaBox can use as is.
store_usable() {
	[[ -d $ROOT ]] || return 1
	case $(store_fstype) in
	btrfs) return 0 ;;
	xfs) reflink_works "$ROOT" ;;
	*) return 1 ;;
	esac
}

step_store() {
	STEP=store
	if store_usable; then
		if mountpoint -q "$ROOT" && [[ $(findmnt -n -o SOURCE --mountpoint "$ROOT") == /dev/loop* ]]; then
			say "already mounted: $(losetup -n -O BACK-FILE "$(findmnt -n -o SOURCE --mountpoint "$ROOT")" | xargs) on $ROOT ($(store_fstype))"
		else
			say "using $ROOT as is: $(store_fstype) with reflink"
		fi
	elif [[ $MODE == check ]]; then
		say "$ROOT is not on a reflink filesystem"
		if [[ -f $STORE_IMAGE ]]; then
			probe "store" MISSING "$STORE_IMAGE exists but is not mounted on $ROOT (reboot?); setup.sh mounts it"
		else
			probe "store" MISSING "$ROOT not on XFS-reflink/btrfs; setup.sh creates and mounts $STORE_IMAGE"
		fi
		return
	else
		mkdir -p "$ROOT"
		if mountpoint -q "$ROOT"; then
			die "$ROOT is a $(store_fstype) mount without reflink" \
				"unmount it, or set DELTABOX_ROOT to a dir on XFS (reflink=1) or btrfs"
		fi
		if [[ -n $(ls -A "$ROOT") ]]; then
			die "$ROOT is not empty and not on a reflink filesystem; mounting the store would hide its files" \
				"move its contents away (or set DELTABOX_ROOT), then re-run"
		fi
		if [[ -f $STORE_IMAGE ]]; then
			mount_store || die "could not mount $STORE_IMAGE on $ROOT" \
				"check it with xfs_repair -n $STORE_IMAGE, or remove it to start an empty store"
			say "mounted existing $STORE_IMAGE on $ROOT $STORE_MOUNT_NOTE"
		else
			mkdir -p "$(dirname "$STORE_IMAGE")"
			truncate -s "$STORE_SIZE" "$STORE_IMAGE.new"
			mkfs.xfs -q -m reflink=1 -n ftype=1 "$STORE_IMAGE.new" || {
				rm -f "$STORE_IMAGE.new"
				die "mkfs.xfs failed on $STORE_IMAGE.new" "apt-get install xfsprogs; check free space"
			}
			mv "$STORE_IMAGE.new" "$STORE_IMAGE"
			mount_store || die "could not loop-mount $STORE_IMAGE on $ROOT" \
				"the kernel needs loop devices (/dev/loop-control) and XFS"
			say "created sparse $STORE_SIZE XFS image $STORE_IMAGE, mounted on $ROOT $STORE_MOUNT_NOTE"
		fi
		store_usable || die "$ROOT was mounted but cp --reflink=always fails on it" "inspect $STORE_IMAGE"
	fi
	local d missing=()
	for d in images layers sandboxes tmp; do [[ -d $ROOT/$d ]] || missing+=("$d"); done
	if [[ $MODE == install ]]; then
		chmod 0700 "$ROOT"
		for d in "${missing[@]}"; do mkdir -p "$ROOT/$d"; done
		if ((${#missing[@]})); then say "created subdirs: ${missing[*]}"; fi
	elif ((${#missing[@]})); then
		probe "store subdirs" MISSING "${missing[*]}"
	fi
	probe "store" ok "$(findmnt -n -o SOURCE,FSTYPE -T "$ROOT" | xargs) at $ROOT"
}

# step_probes: the kernel/filesystem features the daemon depends on. Fixes only subuid/subgid.
step_probes() {
	STEP=probe
	local fs
	if [[ -d $ROOT ]] && store_usable; then
		fs=$(store_fstype)
		probe "reflink (cp)" ok "cp --reflink=always works on $fs"
		# d_type: overlay needs it (XFS ftype=1); btrfs always has it.
		if [[ $fs == xfs ]]; then
			if [[ $(xfs_info "$ROOT" 2>/dev/null) == *ftype=1* ]]; then
				probe "d_type (ftype=1)" ok "xfs_info ftype=1"
			else
				probe "d_type (ftype=1)" FAIL "XFS without ftype=1: overlay will refuse it; recreate the store"
			fi
		else
			probe "d_type (ftype=1)" ok "$fs"
		fi
		local opts qk=0
		opts=$(findmnt -n -o OPTIONS -T "$ROOT")
		xfs_quota_in_kernel || qk=$?
		if [[ ,$opts, == *,prjquota,* ]]; then
			probe "prjquota" ok "mount options: $opts"
		elif [[ $fs == btrfs ]]; then
			probe "prjquota" warn "btrfs: no project quota (use qgroups)"
		elif ((qk == 1)); then
			probe "prjquota" warn "kernel has no CONFIG_XFS_QUOTA: no project quotas ($opts)"
		else
			probe "prjquota" FAIL "no prjquota in '$opts': umount $ROOT and re-run (XFS cannot add it by remount)"
		fi
		probe_overlay
	else
		probe "reflink (cp)" MISSING "store not set up"
	fi

	# User namespaces: a sandbox family runs in one that maps root to 100000-165535.
	if unshare --user --map-root-user true 2>/dev/null; then
		probe "user namespaces" ok "unshare --user --map-root-user"
	else
		probe "user namespaces" FAIL "unshare --user fails: check user.max_user_namespaces"
	fi
	local f
	for f in /etc/subuid /etc/subgid; do
		if grep -qx 'root:100000:65536' "$f" 2>/dev/null; then
			:
		elif [[ $MODE == install ]]; then
			echo 'root:100000:65536' >>"$f"
			say "added root:100000:65536 to $f"
		else
			probe "$(basename "$f")" MISSING "no root:100000:65536 line in $f"
			continue
		fi
		# Another user owning part of 100000-165535 would share host uids with sandboxes.
		local clash
		clash=$(awk -F: '$1 != "root" && $2 < 165536 && $2 + $3 > 100000 { print $1 }' "$f" | xargs)
		if [[ -n $clash ]]; then
			probe "$(basename "$f")" warn "root:100000:65536, overlaps: $clash"
		else
			probe "$(basename "$f")" ok "root:100000:65536"
		fi
	done
	if command -v newuidmap >/dev/null && grep -qx 'root:100000:65536' /etc/subuid 2>/dev/null &&
		unshare --user --map-users=100000,0,65536 --map-groups=100000,0,65536 true 2>/dev/null; then
		probe "userns 100000:65536 map" ok "newuidmap/newgidmap map root -> 100000"
	else
		probe "userns 100000:65536 map" FAIL "unshare --map-users=100000,0,65536 fails: needs uidmap and /etc/sub[ug]id"
	fi

	probe_cgroups
}

# probe_overlay: mount an overlay with the options the daemon uses, lower and upper on the
# store, write through it, and check that copy-up of a lower file reflinks (shared extents).
probe_overlay() {
	local d rc=0 msg base=$ROOT/tmp
	[[ -d $base ]] || base=$ROOT
	d=$(mktemp -d "$base/.overlay-probe.XXXXXX")
	mkdir "$d/lower" "$d/upper" "$d/work" "$d/merged"
	head -c 1048576 /dev/urandom >"$d/lower/big"
	if mount -t overlay overlay \
		-o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work,redirect_dir=on,metacopy=off,index=off" \
		"$d/merged" 2>"$d/err"; then
		echo hello >"$d/merged/new" || rc=1
		echo x >>"$d/merged/big" || rc=1 # copy-up of a 1 MiB lower file
		umount "$d/merged"
		if ((rc)) || [[ $(cat "$d/upper/new") != hello ]]; then
			probe "overlay mount" FAIL "mounted but writing through it failed"
		else
			probe "overlay mount" ok "redirect_dir=on,metacopy=off,index=off"
			if [[ $(filefrag -v "$d/upper/big" 2>/dev/null) == *shared* ]]; then
				probe "overlay copy-up reflink" ok "copied-up file shares extents with lower"
			else
				probe "overlay copy-up reflink" warn "copy-up did not share extents (full copy)"
			fi
		fi
	else
		msg=$(cat "$d/err")
		probe "overlay mount" FAIL "mount -t overlay failed: ${msg:-?}"
	fi
	rm -rf "$d"
}

# cgroup2 at /sys/fs/cgroup/unified tracks, freezes and kills a sandbox's process tree;
# the cgroup v1 controllers (memory, pids, cpu) set its limits, and freezer holds each exec's group.
probe_cgroups() {
	local u=/sys/fs/cgroup/unified
	if [[ $(stat -f -c %T "$u" 2>/dev/null) != cgroup2fs ]]; then
		probe "cgroup2 (unified)" FAIL "no cgroup2 mounted at $u"
	else
		local cg="$u/deltabox-setup-probe.$$" pid rc=0 old
		for old in "$u"/deltabox-setup-probe.*; do rmdir "$old" 2>/dev/null || true; done
		mkdir "$cg"
		if [[ -f $cg/cgroup.kill && -f $cg/cgroup.freeze ]]; then
			sleep 30 &
			pid=$!
			echo "$pid" >"$cg/cgroup.procs"
			echo 1 >"$cg/cgroup.kill"
			wait "$pid" 2>/dev/null || rc=$?
			if ((rc == 137)); then
				probe "cgroup2 (unified)" ok "$u: cgroup.kill killed a test process; cgroup.freeze present"
			else
				kill "$pid" 2>/dev/null || true
				probe "cgroup2 (unified)" FAIL "writing cgroup.kill did not kill the test process (rc=$rc)"
			fi
		else
			probe "cgroup2 (unified)" FAIL "$u has no cgroup.kill/cgroup.freeze (kernel < 5.14?)"
		fi
		rmdir "$cg" 2>/dev/null || true
	fi
	local c missing=()
	for c in memory pids cpu freezer; do
		awk -v c="$c" '$3 == "cgroup" { n = split($4, o, ","); for (i = 1; i <= n; i++) if (o[i] == c) f = 1 }
			END { exit !f }' /proc/self/mounts || missing+=("$c")
	done
	if ((${#missing[@]})); then
		probe "cgroup v1 controllers" FAIL "not mounted: ${missing[*]}"
	else
		probe "cgroup v1 controllers" ok "memory pids cpu freezer"
	fi
}

# ==== Step 4: default image ================================================================
# A real Debian rootfs is cheap here (mmdebstrap minbase in ~20 s), so sandboxes never use the
# host's own directories as layers. It is built in images/.new-default and renamed into place:
# the rename is the commit point, and a leftover .new-* dir from a crash is removed first.
IMAGE_PACKAGES=bash,python3,git,ca-certificates,procps,less,patch,diffutils,findutils,sed,grep,gawk,coreutils,tar,gzip,xz-utils,file,make

step_image() {
	STEP=image
	local img="$ROOT/images/default" stage="$ROOT/images/.new-default" left
	if [[ $MODE == install ]]; then
		for left in "$ROOT"/images/.new-*; do
			[[ -e $left ]] || continue
			rm -rf "$left"
			say "removed leftover $left (an interrupted build)"
		done
	fi
	if [[ -f $img/image.json ]]; then
		say "default image present: $img"
		probe "default image" ok "$img"
		return
	fi
	if [[ $MODE == check ]] || [[ ! -d $ROOT/images ]]; then
		say "default image missing: $img"
		probe "default image" MISSING "$img/image.json"
		return
	fi
	# A half-written image without image.json is not an image.
	if [[ -d $img ]]; then rm -rf "$img"; fi
	# mmdebstrap does not read the host's apt sources: given no MIRROR it uses its built-in
	# default archive and, for a stable suite, adds its own updates and security mirrors,
	# which this machine cannot reach. So pass the host's own bookworm entries (main, updates,
	# security) as one-line MIRROR arguments, read at run time; they also become the image's
	# sources.list. stdin is /dev/null so nothing is ever read from it.
	local -a mirrors=()
	local type uri suite comps signed
	while IFS=$'\t' read -r type uri suite comps signed; do
		[[ $type == deb ]] || continue
		case $suite in "$SUITE" | "$SUITE"-updates | "$SUITE"-security) ;; *) continue ;; esac
		mirrors+=("deb${signed:+ [signed-by=$signed]} $uri $suite ${comps:-main}")
	done < <(apt_source_entries)
	((${#mirrors[@]})) || die "no apt entry for $SUITE to build the image from" \
		"configure the Debian archive for $SUITE under /etc/apt/sources.list.d"
	local t log="$stage/build.log"
	t=$(now_ms)
	mkdir -p "$stage"
	if ! mmdebstrap --variant=minbase --include="$IMAGE_PACKAGES" "$SUITE" "$stage/rootfs" \
		"${mirrors[@]}" </dev/null >"$log" 2>&1; then
		tail -n 15 "$log" >&2
		die "mmdebstrap failed (full log: $log)" "check the apt mirror; re-run (the stage dir is discarded)"
	fi
	local r="$stage/rootfs"
	mkdir -p "$r/proc" "$r/dev" "$r/dev/shm" "$r/tmp" "$r/var/tmp" "$r/workspace" "$r/sys" "$r/run"
	chmod 1777 "$r/dev/shm" "$r/tmp" "$r/var/tmp"
	chmod 0755 "$r/workspace"
	local bytes
	bytes=$(du -sb "$r" | cut -f1)
	printf '{"name":"default","created":"%s","source":"mmdebstrap %s minbase","bytes":%s}\n' \
		"$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$SUITE" "$bytes" >"$stage/image.json"
	sync -f "$stage/image.json"
	mv "$stage" "$img"
	say "built default image in $(secs_since "$t") s: $img ($((bytes / 1048576)) MiB)"
	probe "default image" ok "$img"
}

# ==== Step 4b: the tree-search workload ====================================================
# The evaluation's workload (workload/, examples/): CPython's own json package and its own
# test suite, as a standalone project "jsonlib" that sandboxes get as a git repository. The
# package comes from the default image's libpython3.X-stdlib, the tests (test/test_json) from
# Debian's libpython3.X-testsuite of the same version, fetched with apt-get download (the
# candidate version if the archive no longer has the image's). workload/prepare.py renames the
# imports so the tests exercise the copy, and writes tree/ and manifest.json (written last);
# the directory is built as .new-NAME and renamed into place. Nothing here touches the image.
WORKLOAD_NAME=jsonlib

step_workload() {
	STEP=workload
	local dir="$ROOT/workloads/$WORKLOAD_NAME" stage="$ROOT/workloads/.new-$WORKLOAD_NAME"
	if [[ -f $dir/manifest.json ]]; then
		say "workload present: $dir"
		probe "workload $WORKLOAD_NAME" ok "$dir"
		return
	fi
	local rootfs="$ROOT/images/default/rootfs"
	if [[ $MODE == check ]] || [[ ! -f $ROOT/images/default/image.json ]]; then
		say "workload missing: $dir"
		probe "workload $WORKLOAD_NAME" MISSING "$dir/manifest.json"
		return
	fi
	local pkg ver
	read -r pkg ver < <(dpkg-query --admindir="$rootfs/var/lib/dpkg" -W -f='${db:Status-Status} ${Package} ${Version}\n' \
		'libpython3.*-stdlib' 2>/dev/null | awk '$1 == "installed" { print $2, $3; exit }') || true
	[[ -n ${pkg:-} && -n ${ver:-} ]] || die "no libpython3.X-stdlib in the default image ($rootfs)" \
		"rebuild the image: rm -rf $ROOT/images/default and re-run"
	local pyver=${pkg#libpython}
	pyver=${pyver%-stdlib}
	local tpkg="libpython$pyver-testsuite" t log="$stage/build.log" got="$ver"
	t=$(now_ms)
	rm -rf "$stage"
	mkdir -p "$stage/deb"
	workload_fetch() { (cd "$stage/deb" && apt-get download -q -o APT::Sandbox::User=root "$@") >>"$log" 2>&1; }
	if ! workload_fetch "$tpkg=$ver"; then
		apt-get update -qq >>"$log" 2>&1 || true
		if ! workload_fetch "$tpkg=$ver"; then
			workload_fetch "$tpkg" || die "apt-get download $tpkg failed (see $log)" \
				"check the apt sources; apt-cache policy $tpkg must show a candidate"
			got=$(dpkg-deb -f "$stage"/deb/"$tpkg"_*.deb Version)
			say "the archive no longer has $tpkg $ver: using $got"
		fi
	fi
	local deb
	deb=$(echo "$stage"/deb/"$tpkg"_*.deb)
	dpkg-deb -x "$deb" "$stage/deb/x"
	local py=python3
	[[ -x /usr/bin/python3 ]] && py=/usr/bin/python3
	"$py" "$SCRIPT_DIR/../workload/prepare.py" \
		--json-src "$rootfs/usr/lib/python$pyver/json" \
		--tests-src "$stage/deb/x/usr/lib/python$pyver/test/test_json" \
		--license "$rootfs/usr/share/doc/$pkg/copyright" \
		--dest "$stage/out" \
		--meta "python=$pyver" \
		--meta "json_from=$pkg $ver (the default image's /usr/lib/python$pyver/json)" \
		--meta "tests_from=$tpkg $got (test/test_json)" \
		--meta "testsuite_deb_sha256=$(sha256sum "$deb" | cut -d' ' -f1)" \
		>>"$log" 2>&1 || { tail -n 5 "$log" >&2; die "workload/prepare.py failed (see $log)" \
		"a different upstream version? compare its rewrite rules with the files"; }
	mkdir -p "$ROOT/workloads"
	mv "$stage/out" "$dir"
	rm -rf "$stage"
	say "prepared workload $WORKLOAD_NAME in $(secs_since "$t") s: $dir (json from $pkg $ver, tests from $tpkg $got)"
	probe "workload $WORKLOAD_NAME" ok "$dir"
}

# ==== Step 4c: the SWE-bench-sized workload ==============================================
# Django 4.2 as SWE-bench holds a task: the repository (git) with its own test suite
# (tests/runtests.py, sqlite) and the Python environment its tests need, both in the
# workspace. The source is Debian's python-django orig tarball (trixie's deb-src, the entry
# step_criu adds; apt-get source --download-only, as CRIU's), the environment Debian's
# python3-asgiref and python3-sqlparse (bookworm, the image's Python); all three are checked
# against the sha256 pinned here before workload/prepare_django.py unpacks them, and the
# manifest records every file's sha256 (workload/workspace.py checks them at each load).
# Downloads are cached in $DJANGO_SRC_DIR; the tree is built as .new-django and renamed.
DJANGO_DEB_VERSION=3:4.2.28-0+deb13u2
DJANGO_ORIG=python-django_4.2.28.orig.tar.gz
DJANGO_ORIG_SHA256=a4b9cd881991add394cafa8bb3b11ad1742d1e1470ba99c3ef53dc540316ccfe
DJANGO_ENV_DEBS=(
	"python3-asgiref=3.6.0-1 python3-asgiref_3.6.0-1_all.deb 5c7835a18144105fc24172c2fb27a2d2e0b10d80df7bf9615664cefc8b065258"
	"python3-sqlparse=0.4.2-1+deb12u1 python3-sqlparse_0.4.2-1+deb12u1_all.deb edd31cf6974984723034321451333ff375d0551baf375e8bc0ececaff661eabb"
)
DJANGO_SRC_DIR=/var/cache/deltabox/django-src

sha_is() { [[ -f $1 ]] && [[ $(sha256sum "$1" | cut -d' ' -f1) == "$2" ]]; }

step_workload_django() {
	STEP=workload
	local name=django dir="$ROOT/workloads/django" stage="$ROOT/workloads/.new-django"
	if [[ -f $dir/manifest.json ]]; then
		say "workload present: $dir"
		probe "workload $name" ok "$dir"
		return
	fi
	if [[ $MODE == check ]]; then
		say "workload missing: $dir"
		probe "workload $name" MISSING "$dir/manifest.json"
		return
	fi
	local t log="$DJANGO_SRC_DIR/apt.log" e spec deb sum debs=()
	t=$(now_ms)
	mkdir -p "$DJANGO_SRC_DIR/deb" "$CRIU_SRC_DIR"
	if ! sha_is "$DJANGO_SRC_DIR/$DJANGO_ORIG" "$DJANGO_ORIG_SHA256"; then
		rm -f "$DJANGO_SRC_DIR/$DJANGO_ORIG"
		ensure_trixie_src
		# As for CRIU: the exit code is ignored, the tarball is checked by name and sha256.
		(cd "$DJANGO_SRC_DIR" && apt-get source -q --download-only "python-django=$DJANGO_DEB_VERSION") >>"$log" 2>&1 || true
		sha_is "$DJANGO_SRC_DIR/$DJANGO_ORIG" "$DJANGO_ORIG_SHA256" || die \
			"apt-get source did not fetch $DJANGO_ORIG with sha256 $DJANGO_ORIG_SHA256 (see $log)" \
			"check $TRIXIE_SRC_LIST and apt-cache showsrc python-django (want $DJANGO_DEB_VERSION)"
	fi
	for e in "${DJANGO_ENV_DEBS[@]}"; do
		read -r spec deb sum <<<"$e"
		if ! sha_is "$DJANGO_SRC_DIR/deb/$deb" "$sum"; then
			rm -f "$DJANGO_SRC_DIR/deb/$deb"
			(cd "$DJANGO_SRC_DIR/deb" && apt-get download -q -o APT::Sandbox::User=root "$spec") >>"$log" 2>&1 || true
			sha_is "$DJANGO_SRC_DIR/deb/$deb" "$sum" || die "apt-get download $spec did not give $deb with sha256 $sum (see $log)" \
				"apt-get update; apt-cache policy ${spec%%=*} must list ${spec#*=}"
		fi
		debs+=(--deb "$DJANGO_SRC_DIR/deb/$deb")
	done
	rm -rf "$stage"
	mkdir -p "$ROOT/workloads"
	local py=python3
	[[ -x /usr/bin/python3 ]] && py=/usr/bin/python3
	"$py" "$SCRIPT_DIR/../workload/prepare_django.py" --orig "$DJANGO_SRC_DIR/$DJANGO_ORIG" "${debs[@]}" \
		--dest "$stage" --meta "version=4.2.28" --meta "orig=$DJANGO_ORIG (python-django $DJANGO_DEB_VERSION, apt-get source)" \
		--meta "orig_sha256=$DJANGO_ORIG_SHA256" >>"$log" 2>&1 || { tail -n 5 "$log" >&2; die "workload/prepare_django.py failed (see $log)" \
		"rm -rf $stage and re-run"; }
	mv "$stage" "$dir"
	say "prepared workload $name in $(secs_since "$t") s: $dir (Django 4.2.28 from $DJANGO_ORIG, env from Debian)"
	probe "workload $name" ok "$dir"
}

# ==== Step 5: Go ===========================================================================
# The toolchain is preinstalled on this machine kind in /usr/local/go; nothing to install.
step_go() {
	STEP=go
	if command -v go >/dev/null; then
		say "$(go version) at $(command -v go)"
		probe "go" ok "$(command -v go)"
	else
		say "go not found on PATH or in /usr/local/go/bin"
		probe "go" MISSING "install Go in /usr/local/go (no registry serves the toolchain here)"
	fi
}

# ==== Step 6: E2B's SDK ====================================================================
# tests/e2e/e2b_test.go drives the daemon with E2B's own SDK, the npm package pinned in
# tests/e2b/package.json (and its lock file). Installed only when the installed version is
# not the pinned one (a re-run touches nothing).
step_e2b_sdk() {
	STEP=e2b-sdk
	local dir=$SCRIPT_DIR/../tests/e2b want have
	if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
		probe "e2b sdk" MISSING "install Node.js 18+ and npm, then: cd tests/e2b && npm ci"
		return
	fi
	want=$(node -p 'require(process.argv[1]).dependencies.e2b' "$dir/package.json")
	have=$(node -p 'require(process.argv[1]).version' "$dir/node_modules/e2b/package.json" 2>/dev/null || true)
	if [[ $have != "$want" ]]; then
		say "npm ci in tests/e2b (e2b $want)"
		(cd "$dir" && npm ci --no-audit --no-fund >/var/cache/deltabox/npm.log 2>&1) ||
			die "npm ci failed in tests/e2b (see /var/cache/deltabox/npm.log)" "check that the npm registry is reachable"
		have=$want
	fi
	probe "e2b sdk" ok "e2b $have in tests/e2b/node_modules"
}

step_packages
step_criu
step_store
step_probes
step_image
step_workload
step_workload_django
step_go
step_e2b_sdk

STEP=setup
echo
probe_table
echo
if ((PROBES_FAILED)); then
	say "$PROBES_FAILED probe(s) not ok ($(secs_since "$T0") s)"
	exit 1
fi
say "all done in $(secs_since "$T0") s"
