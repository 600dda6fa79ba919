package state

import (
	"errors"
	"slices"
	"sort"
	"strconv"

	"deltabox/internal/fastpath"
	"deltabox/internal/remote"
	"deltabox/internal/sandbox"
	"deltabox/internal/store"
)

// A fast fork's family outlives the daemon as its sandboxes do (restart.go). What the
// next daemon needs, the members' records name (store.FamilyRef): the holder's init and
// cgroups, and whether the fork that made the family finished. Written in this order:
//
//  1. each branch's record as the branch is made, Made false (createFastBranch);
//  2. the holder: the family init and its templates into the family's cgroups
//     (sandbox.BecomeHolder), the source's move;
//  3. the source's record and every branch's, Made true (recordFamily), before the
//     answer.
//
// At start-up (adoptFamilies): a family none of whose records is Made was cut by a crash
// before its answer: its branches' records are deleted (their cgroups, and with them
// their inits and copies, and their directories are swept as any unrecorded sandbox's),
// and its source, if the cut came after step 2 (the family's cgroups exist: its live
// processes were being ended), restarts afresh on its files, which are the fork's node.
// A family with a Made record is adopted: the holder first (its init reconnected, its
// templates reattached: process records of the family, or of the source whose templates
// run in the holder's PID namespace), then each member as any sandbox, its init a branch
// init of the holder (sandbox.Adopt's family). The family's cgroups are spared by the
// sweep; the source's directory, which holds the family's id range, stays while the
// family lives, the source removed or not.

// recordFamily is step 3: src's record and each branch's say the family is made, in
// one transaction of the index.
// +checklocksignore: forkFast's, under src.opMu; the branches are not answered yet
func (m *Manager) recordFamily(src *sb, fam *family, fref store.FamilyRef, branches []*sb) {
	fref.Made = true
	m.mu.Lock()
	defer m.mu.Unlock()
	var ops []store.Op
	var who []*sb
	if src != nil && m.famOf[src.rec.ID] == fam {
		f := fref
		src.rec.Family = &f
		if src.rt == nil {
			src.rec.Init = nil // its old init is the holder's: a next start restarts it afresh
		}
		ops, who = append(ops, store.Op{PutSandbox: &src.rec}), append(who, src)
	}
	for _, s := range branches {
		if m.sandboxes[s.rec.ID] != s {
			continue // removed meanwhile
		}
		f := fref
		s.rec.Family = &f
		ops, who = append(ops, store.Op{PutSandbox: &s.rec}), append(who, s)
	}
	seq := m.st.Index.Apply(ops...)
	for _, s := range who {
		s.seq = seq
	}
}

// crashPointRecorded is crashPoint once what the index was handed is committed: a
// fork's cut points are about the order of its records, not the committer's timing.
func (m *Manager) crashPointRecorded(op string, k int) {
	if m.crashAt == op+":"+strconv.Itoa(k) {
		_ = m.st.Index.WaitDurable(m.st.Index.Seq()) // an error is the index's, reported by its next durable op
	}
	m.crashPoint(op, k)
}

// famRecord is one family as the index's records show it.
type famRecord struct {
	ref     store.FamilyRef
	made    bool
	members []string
}

// loadFamilies groups the records' families, by family id.
func loadFamilies(sbs []store.Sandbox) map[string]*famRecord {
	out := map[string]*famRecord{}
	for _, r := range sbs {
		if r.Family == nil {
			continue
		}
		fr := out[r.Family.ID]
		if fr == nil {
			fr = &famRecord{ref: *r.Family}
			out[r.Family.ID] = fr
		}
		fr.made = fr.made || r.Family.Made
		fr.members = append(fr.members, r.ID)
	}
	return out
}

// adoptFamilies is the start-up's part for fast fork families (see above). It returns
// the records left to load (the cut branches' deleted), the families whose holder was
// adopted (their cgroups are spared), the sources that restart afresh (cut after their
// holder was made), and the sandboxes the store's sweep must keep (a removed source's
// directory).
// +checklocksignore: start-up, called by New before the manager is shared
func (m *Manager) adoptFamilies(sbs []store.Sandbox, byID map[string]*sb, procs map[string]nodeProcesses, cgroups map[string]bool) (left []store.Sandbox, held map[string]bool, afresh map[string]bool, keep []store.Sandbox) {
	fams := loadFamilies(sbs)
	held, afresh = map[string]bool{}, map[string]bool{}
	cut := map[string]bool{}
	for _, r := range sbs {
		// A family's later fork (forkFamily) cut by a crash leaves its branches' records
		// not Made in a made family: they are removed as a first fork's are.
		if fr := fams[idOrEmpty(r.Family)]; fr != nil && (!fr.made || !r.Family.Made) {
			m.log.Info("a fork cut by a crash: its branch is removed", "sandbox", r.ID, "family", fr.ref.ID)
			m.st.Index.Apply(store.Op{DeleteSandbox: r.ID})
			cut[r.ID] = true
			continue
		}
		left = append(left, r)
	}
	for _, fr := range fams {
		fr.members = slices.DeleteFunc(fr.members, func(id string) bool { return cut[id] })
	}
	ids := make([]string, 0, len(fams))
	for id := range fams {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		fr := fams[id]
		if !fr.made {
			if cgroups[id] {
				afresh[fr.ref.Source] = true
			}
			continue
		}
		if byID[fr.ref.Source] == nil {
			keep = append(keep, store.Sandbox{ID: fr.ref.Source})
		}
		fam := &family{id: id, src: fr.ref.Source, members: map[string]bool{}}
		for _, mid := range fr.members {
			fam.members[mid] = true
			m.famOf[mid] = fam
			fam.base = byID[mid].rec.UIDBase
		}
		m.families = append(m.families, fam)
		if err := m.adoptHolder(fam, fr, byID, procs); err != nil {
			// Its members restart afresh, files only, still a family for their id range.
			m.log.Warn("fork family's holder not adopted: its members restart afresh", "family", id, "err", err)
			continue
		}
		held[id] = true
		m.log.Info("adopted a fork family's holder", "family", id, "init", fr.ref.Holder.Pid, "members", len(fr.members))
	}
	return left, held, afresh, keep
}

func idOrEmpty(f *store.FamilyRef) string {
	if f == nil {
		return ""
	}
	return f.ID
}

// adoptHolder takes over fam's holder: its init, on the family's cgroups, and the
// templates of the nodes made before the fork.
// +checklocksignore: start-up, called by New before the manager is shared
func (m *Manager) adoptHolder(fam *family, fr *famRecord, byID map[string]*sb, procs map[string]nodeProcesses) error {
	if m.cfg.NoIsolation || fam.base == 0 {
		return errors.New("the daemon's isolation setting changed")
	}
	iso, _, err := m.isolation(byID[fr.members[0]], false)
	if err != nil {
		return err
	}
	hostname := fam.src
	if s := byID[fam.src]; s != nil {
		hostname = s.rec.Hostname
	}
	rt, warn, err := sandbox.Adopt(fam.id, hostname, m.st.SandboxDir(fam.src), iso, nil, fr.ref.Holder.Pid, fr.ref.Holder.Start)
	if err != nil {
		return err
	}
	if warn != nil {
		m.log.Warn("adopt a fork family's holder", "family", fam.id, "warning", warn)
	}
	fam.rt, fam.tracer = rt, remote.NewTracer()
	nodes := make([]string, 0, len(procs))
	for n := range procs {
		nodes = append(nodes, n)
	}
	sort.Strings(nodes)
	for _, node := range nodes {
		np := procs[node]
		mine := np.Sandbox == fam.id ||
			np.Sandbox == fam.src && len(np.Templates) > 0 && fastpath.SamePidNS(np.Templates[0].Template.HostPid, rt.InitPid())
		nd := m.nodes[node]
		if !mine || nd == nil {
			continue
		}
		var tps []*procTemplate
		for _, tr := range np.Templates {
			t, err := fastpath.Reattach(fam.tracer, tr.Template)
			if err != nil {
				m.log.Warn("a fork family's template not taken back: its node restores from its image or files only", "family", fam.id, "node", node, "process", tr.What, "err", err)
				continue
			}
			tps = append(tps, &procTemplate{session: tr.Session, what: tr.What, kind: tr.Kind, argv: tr.Argv, sandbox: fam.id, tmpl: t, term: tr.Term, parked: true})
		}
		if len(tps) > 0 {
			m.templates[node] = tps
			nd.uts = np.UTS
		}
	}
	return nil
}

// familyAdoptable says why member s cannot be adopted because of its family ("" when
// it can be tried): a member's init is a branch init of the holder.
// +checklocksignore: start-up, called by New before the manager is shared
func (m *Manager) familyAdoptable(s *sb) string {
	fam := m.famOf[s.rec.ID]
	switch {
	case fam == nil:
		return ""
	case fam.rt == nil:
		return "its fork family's holder was not adopted"
	case s.rec.Init != nil && s.rec.Init.Pid == fam.rt.InitPid():
		return "its move into a namespace of its own at its fork was cut"
	}
	return ""
}

// recordFamilyTemplates records the adopted holders' templates again: Reattach moved
// their counters (as restart.go's recordTemplates after a sandbox's adoption).
func (m *Manager) recordFamilyTemplates() {
	m.mu.Lock()
	type job struct {
		fam  *family
		node string
		tps  []*procTemplate
	}
	var jobs []job
	for _, fam := range m.families {
		for node, tps := range m.templates {
			if len(tps) > 0 && tps[0].sandbox == fam.id {
				jobs = append(jobs, job{fam, node, tps})
			}
		}
	}
	m.mu.Unlock()
	for _, j := range jobs {
		m.recordTemplatesOf(j.fam.id, &j.fam.mu, j.node, j.tps)
	}
}
