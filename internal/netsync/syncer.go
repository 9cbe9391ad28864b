package netsync

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	cerrdefs "github.com/containerd/errdefs"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/netspec"
)

// Engine is the local Docker engine as netsync needs it. Its methods may
// block on the engine; the syncer calls them from its own goroutine only.
type Engine interface {
	// Networks lists the engine's networks of driver, each inspected
	// (definition, creation time, containers attached).
	Networks(ctx context.Context, driver string) ([]Network, error)
	// Create creates the network s with driver and returns its ID.
	Create(ctx context.Context, s netspec.Spec, driver string) (string, error)
	// Remove removes the network id; the engine refuses one in use.
	Remove(ctx context.Context, id string) error
	// Calls is how many API requests were made (for the status).
	Calls() uint64
}

// Transport is the cluster's application messages. Send may block (a
// stream to the member); the syncer calls it from its sender goroutine.
type Transport interface {
	// Members is the alive members that take application messages,
	// never this host.
	Members() []string
	Send(node string, payload []byte) error
}

// Store persists the table and the ledger (the state file's meta
// records: a nil value deletes its key).
type Store interface {
	ListMeta(prefix string) (map[string][]byte, error)
	UpdateMeta(puts map[string][]byte) error
}

const (
	keyLedger      = "netsync/ledger"
	keyEntryPrefix = "netsync/entry/"
)

// Config is a syncer's.
type Config struct {
	Host      string // this host's cluster name
	Driver    string // the local engine's name of overlayd's network driver
	Engine    Engine
	Transport Transport
	Store     Store
	Log       *slog.Logger
	// Interval: the engine is read and the plan carried out at least
	// this often (default 10 s: each read is one list and one inspect per
	// overlayd network); the engine's network events and new entries
	// kick it at once, so this only bounds how long a lost event lasts.
	Interval time.Duration
	// SyncInterval: the whole table goes to one random member this often
	// (default 2 s): anti-entropy for lost pushes.
	SyncInterval time.Duration
	Now          func() time.Time
}

// Syncer carries out the plans of one host. Make it with New and run it
// with Run; Poke, HandleMessage, MembersChanged and Status never block.
type Syncer struct {
	cfg   Config
	table *Table

	kick   chan struct{}    // a plan is wanted soon
	inbox  chan inbound     // peers' messages, for the loop
	outbox chan outbound    // messages to send, for the sender
	joined chan struct{}    // members changed: send the table to all
	drops  atomic.Uint64    // messages dropped: a full inbox or outbox
	mu     *lockorder.Mutex // level LevelLeaf: guards the fields below

	ledger Ledger // guarded by mu; the loop's, persisted
	status Status // guarded by mu
	// usage: what other hosts keep in use although removed, by host,
	// as last heard (guarded by mu; older than usageTTL is dropped).
	usage  map[string]heardUsage
	warned map[string]string
	errLog string // the last engine or store error logged (once per distinct one)
}

type heardUsage struct {
	at   time.Time
	kept []Kept
}

// usageTTL: a host's report of what it keeps is in force this many sync
// intervals (it repeats it every interval while it keeps something).
const usageTTL = 3

type inbound struct {
	from    string
	payload []byte
}

type outbound struct {
	node    string
	payload []byte
}

// Status is what `overlayd status` shows of netsync.
type Status struct {
	Driver    string        `json:"driver"`
	Entries   []StatusEntry `json:"entries"`
	Conflicts []Conflict    `json:"conflicts,omitempty"`
	Kept      []Kept        `json:"kept,omitempty"`
	// Elsewhere: networks the cluster removed that other hosts keep
	// while in use, with their containers there.
	Elsewhere []UsedElsewhere `json:"elsewhere,omitempty"`
	// LastError is the last engine or state-file error, "" once a plan
	// went through.
	LastError string `json:"last_error,omitempty"`
	Created   uint64 `json:"replicas_created"` // since start
	Removed   uint64 `json:"replicas_removed"` // since start
	Dropped   uint64 `json:"messages_dropped"` // anti-entropy repairs them
	// EngineCalls: Engine API requests made since start.
	EngineCalls uint64 `json:"engine_calls"`
}

// Live is how many of the entries are live (the others are removals).
func (st *Status) Live() int {
	n := 0
	for _, e := range st.Entries {
		if e.Live {
			n++
		}
	}
	return n
}

// UsedElsewhere is a removed network another host keeps in use.
type UsedElsewhere struct {
	Name       string `json:"name"`
	Host       string `json:"host"`
	Containers int    `json:"containers"`
}

// StatusEntry is one entry as the status shows it.
type StatusEntry struct {
	Name string    `json:"name"`
	Live bool      `json:"live"`
	Host string    `json:"by"`
	Time time.Time `json:"at"`
}

// New loads the table and the ledger from the store.
func New(cfg Config) (*Syncer, error) {
	if cfg.Host == "" || cfg.Driver == "" || cfg.Engine == nil || cfg.Transport == nil || cfg.Store == nil {
		return nil, fmt.Errorf("netsync: host, driver, engine, transport and store are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.SyncInterval <= 0 {
		cfg.SyncInterval = 2 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	s := &Syncer{cfg: cfg, kick: make(chan struct{}, 1), inbox: make(chan inbound, 64), outbox: make(chan outbound, 256),
		joined: make(chan struct{}, 1), mu: lockorder.New(lockorder.LevelLeaf), ledger: NewLedger(), warned: map[string]string{},
		usage: map[string]heardUsage{}}
	recs, err := cfg.Store.ListMeta("netsync/")
	if err != nil {
		return nil, fmt.Errorf("netsync: read the state file: %w", err)
	}
	var entries []Entry
	for k, v := range recs {
		switch {
		case k == keyLedger:
			l, err := decodeLedger(v)
			if err != nil {
				return nil, fmt.Errorf("netsync: state file record %s: %w", k, err)
			}
			s.ledger = l
		case strings.HasPrefix(k, keyEntryPrefix):
			m, err := decodeMessage(v)
			if err != nil || len(m.entries) != 1 {
				return nil, fmt.Errorf("netsync: state file record %s: %v", k, err)
			}
			entries = append(entries, m.entries[0])
		}
	}
	s.table = NewTable(entries)
	s.status.Driver = cfg.Driver
	return s, nil
}

// Poke asks for a plan soon (an engine event, a new entry).
func (s *Syncer) Poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// MembersChanged sends the whole table to every member soon (a member
// that joins or returns learns every network at once).
func (s *Syncer) MembersChanged() {
	select {
	case s.joined <- struct{}{}:
	default:
	}
}

// HandleMessage queues a copy of a peer's message (the caller may reuse
// payload); it never blocks (a full queue drops it: the next anti-entropy
// round repairs).
func (s *Syncer) HandleMessage(from string, payload []byte) {
	if len(payload) > maxMessage {
		s.drops.Add(1)
		return
	}
	select {
	case s.inbox <- inbound{from, append([]byte(nil), payload...)}:
	default:
		s.drops.Add(1)
	}
}

// Status is a copy of what the syncer last saw and did.
func (s *Syncer) Status() Status {
	s.mu.Lock()
	st := s.status
	st.Conflicts = slices.Clone(st.Conflicts)
	st.Kept = slices.Clone(st.Kept)
	cutoff := s.cfg.Now().Add(-usageTTL * s.cfg.SyncInterval)
	for host, u := range s.usage {
		if u.at.Before(cutoff) {
			continue
		}
		for _, k := range u.kept {
			st.Elsewhere = append(st.Elsewhere, UsedElsewhere{Name: k.Name, Host: host, Containers: k.Endpoints})
		}
	}
	s.mu.Unlock()
	slices.SortFunc(st.Elsewhere, func(a, b UsedElsewhere) int { return strings.Compare(a.Name+"/"+a.Host, b.Name+"/"+b.Host) })
	for _, e := range s.table.List() {
		st.Entries = append(st.Entries, StatusEntry{Name: e.Name, Live: e.Live, Host: e.Stamp.Host, Time: time.Unix(0, e.Stamp.Time).UTC()})
	}
	st.Dropped = s.drops.Load()
	st.EngineCalls = s.cfg.Engine.Calls()
	return st
}

// Run plans and carries out until ctx ends.
func (s *Syncer) Run(ctx context.Context) {
	go s.sender(ctx)
	tick := time.NewTicker(s.cfg.Interval)
	defer tick.Stop()
	sync := time.NewTicker(s.cfg.SyncInterval)
	defer sync.Stop()
	s.reconcile(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			s.expire()
			s.reconcile(ctx)
		case <-s.kick:
			s.reconcile(ctx)
		case <-sync.C:
			ms := s.cfg.Transport.Members()
			if len(ms) > 0 {
				s.send(kindSync, s.table.List(), ms[rand.IntN(len(ms))])
			}
			s.mu.Lock()
			kept := slices.Clone(s.status.Kept)
			s.mu.Unlock()
			if len(kept) > 0 {
				s.sendUsage(kept, ms)
			}
		case <-s.joined:
			s.send(kindSync, s.table.List(), s.cfg.Transport.Members()...)
		case in := <-s.inbox:
			s.receive(in)
		}
	}
}

func (s *Syncer) receive(in inbound) {
	m, err := decodeMessage(in.payload)
	if err != nil {
		s.cfg.Log.Warn("netsync message refused", "from", in.from, "error", err)
		return
	}
	if m.kind == kindUsage {
		s.heardUsage(in.from, m.usage)
		return
	}
	took := s.table.Merge(m.entries)
	if len(took) > 0 {
		if err := s.persistEntries(took); err != nil {
			s.logErr("store", err)
		}
		s.Poke()
	}
	if m.kind == kindSync {
		if back := s.table.Older(m.entries); len(back) > 0 {
			s.send(kindPush, back, in.from)
		}
	}
}

// sendUsage tells nodes what this host keeps in use although removed.
func (s *Syncer) sendUsage(kept []Kept, nodes []string) {
	b, err := encodeMessage(&message{kind: kindUsage, usage: kept[:min(len(kept), MaxEntries)]})
	if err != nil {
		s.cfg.Log.Error("netsync: encode usage", "error", err)
		return
	}
	for _, n := range nodes {
		select {
		case s.outbox <- outbound{n, b}:
		default:
			s.drops.Add(1)
		}
	}
}

// heardUsage records what host keeps in use; the host that removed such
// a network logs, once per network and host, where it is still used.
func (s *Syncer) heardUsage(host string, kept []Kept) {
	entries := s.table.Map()
	s.mu.Lock()
	prev := s.usage[host]
	s.usage[host] = heardUsage{at: s.cfg.Now(), kept: kept}
	s.mu.Unlock()
	for _, k := range kept {
		e, ok := entries[k.Name]
		if !ok || e.Live || e.Stamp.Host != s.cfg.Host || slices.ContainsFunc(prev.kept, func(p Kept) bool { return p.Name == k.Name }) {
			continue
		}
		s.cfg.Log.Info("network removed here is still used on another host; removed there once idle",
			"network", k.Name, "host", host, "containers", k.Endpoints, logkeys.Event, logkeys.NetsyncUsedElsewhere)
	}
}

// send queues entries for nodes, in pages; a full outbox drops (counted).
func (s *Syncer) send(kind byte, entries []Entry, nodes ...string) {
	if len(entries) == 0 || len(nodes) == 0 {
		return
	}
	ps, err := pages(kind, entries)
	if err != nil {
		s.cfg.Log.Error("netsync: encode entries", "error", err)
		return
	}
	for _, n := range nodes {
		for _, p := range ps {
			select {
			case s.outbox <- outbound{n, p}:
			default:
				s.drops.Add(1)
			}
		}
	}
}

func (s *Syncer) sender(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case o := <-s.outbox:
			if err := s.cfg.Transport.Send(o.node, o.payload); err != nil {
				s.cfg.Log.Debug("netsync message not sent", "to", o.node, "error", err)
			}
		}
	}
}

func (s *Syncer) expire() {
	gone := s.table.Expire(s.cfg.Now())
	if len(gone) == 0 {
		return
	}
	puts := map[string][]byte{}
	for _, name := range gone {
		puts[keyEntryPrefix+name] = nil
	}
	if err := s.cfg.Store.UpdateMeta(puts); err != nil {
		s.logErr("store", err)
	}
}

// reconcile reads the engine, plans, persists and carries out the plan.
func (s *Syncer) reconcile(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	nets, err := s.cfg.Engine.Networks(ctx, s.cfg.Driver)
	if err != nil {
		s.logErr("engine", err)
		return
	}
	s.mu.Lock()
	ledger := s.ledger
	s.mu.Unlock()
	p := Compute(Input{Host: s.cfg.Host, Now: s.cfg.Now(), Networks: nets, Entries: s.table.Map(), Ledger: ledger})

	// Nothing leaves this host, and nothing is asked of the engine,
	// before the ledger and the writes are on disk: a restart must tell
	// netsync's acts from the user's.
	puts, err := entryPuts(p.Writes)
	if err == nil {
		var b []byte
		b, err = encodeLedger(p.Ledger)
		puts[keyLedger] = b
	}
	if err == nil {
		err = s.cfg.Store.UpdateMeta(puts)
	}
	if err != nil {
		s.logErr("store", err)
		return
	}
	s.mu.Lock()
	s.ledger = p.Ledger
	s.mu.Unlock()
	if took := s.table.Merge(p.Writes); len(took) > 0 {
		for _, e := range took {
			s.cfg.Log.Info("network definition written", "network", e.Name, "live", e.Live, logkeys.Event, logkeys.NetsyncWrite)
		}
		s.send(kindPush, took, s.cfg.Transport.Members()...)
	}

	var created, removed uint64
	for _, sp := range p.Create {
		id, err := s.cfg.Engine.Create(ctx, sp, s.cfg.Driver)
		if err != nil && cerrdefs.IsConflict(err) {
			// The user or compose made it meanwhile: the next plan
			// sees it (the same definition is the cluster's).
			s.cfg.Log.Debug("a network of that name appeared meanwhile; read again", "network", sp.Name, "error", err)
			s.Poke()
			continue
		}
		if err != nil {
			s.warnOnce("create/"+sp.Name, err.Error(), "replica not created; retried", "network", sp.Name, "error", err, "retry", CreateRetry)
			continue
		}
		created++
		s.cfg.Log.Info("replica created", "network", sp.Name, "id", id, logkeys.Event, logkeys.NetsyncCreate)
	}
	var unasked []string
	for _, n := range p.Remove {
		if err := s.cfg.Engine.Remove(ctx, n.ID); err != nil {
			unasked = append(unasked, n.ID)
			s.warnOnce("remove/"+n.Name, err.Error(), "replica not removed; retried", "network", n.Name, "id", n.ID, "error", err)
			continue
		}
		removed++
		s.cfg.Log.Info("replica removed", "network", n.Name, "id", n.ID, logkeys.Event, logkeys.NetsyncRemove)
	}
	for _, c := range p.Conflicts {
		s.warnOnce("conflict/"+c.Name, strings.Join(c.Diff, "; "), "network of this name differs from the cluster's definition: left alone",
			"network", c.Name, "id", c.ID, "differences", strings.Join(c.Diff, "; "), logkeys.Event, logkeys.NetsyncConflict)
	}
	for _, k := range p.Kept {
		s.warnOnce("kept/"+k.Name, "", "network removed in the cluster, kept here while in use", "network", k.Name, "containers", k.Endpoints, logkeys.Event, logkeys.NetsyncKept)
	}

	s.mu.Lock()
	for _, id := range unasked {
		delete(s.ledger.Removing, id) // asked again on the next plan
	}
	s.status.Conflicts, s.status.Kept = p.Conflicts, p.Kept
	s.status.Created += created
	s.status.Removed += removed
	s.status.LastError = ""
	if s.errLog != "" {
		s.cfg.Log.Info("netsync works again", "last_error", s.errLog)
		s.errLog = ""
	}
	for key := range s.warned {
		if !stillReported(key, p) {
			delete(s.warned, key)
		}
	}
	s.mu.Unlock()
}

func stillReported(key string, p Plan) bool {
	kind, name, _ := strings.Cut(key, "/")
	switch kind {
	case "conflict":
		return slices.ContainsFunc(p.Conflicts, func(c Conflict) bool { return c.Name == name })
	case "kept":
		return slices.ContainsFunc(p.Kept, func(k Kept) bool { return k.Name == name })
	case "create":
		return slices.ContainsFunc(p.Create, func(sp netspec.Spec) bool { return sp.Name == name })
	case "remove":
		return slices.ContainsFunc(p.Remove, func(n Network) bool { return n.Name == name })
	}
	return false
}

// warnOnce logs msg at WARN the first time key is reported with detail,
// and again only when its detail changes.
func (s *Syncer) warnOnce(key, detail, msg string, args ...any) {
	s.mu.Lock()
	seen, ok := s.warned[key]
	s.warned[key] = detail
	s.mu.Unlock()
	if ok && seen == detail {
		return
	}
	s.cfg.Log.Warn(msg, args...)
}

func (s *Syncer) logErr(what string, err error) {
	msg := what + ": " + err.Error()
	s.mu.Lock()
	s.status.LastError = msg
	first := s.errLog != msg
	s.errLog = msg
	s.mu.Unlock()
	if first {
		s.cfg.Log.Warn("netsync cannot go on; retried (logged again only if the error changes)", "part", what, "error", err)
	}
}

func entryPuts(es []Entry) (map[string][]byte, error) {
	puts := make(map[string][]byte, len(es)+1)
	for _, e := range es {
		b, err := encodeMessage(&message{kind: kindPush, entries: []Entry{e}})
		if err != nil {
			return nil, err
		}
		puts[keyEntryPrefix+e.Name] = b
	}
	return puts, nil
}

func (s *Syncer) persistEntries(es []Entry) error {
	puts, err := entryPuts(es)
	if err != nil {
		return err
	}
	return s.cfg.Store.UpdateMeta(puts)
}

type wireKnown struct {
	Name    string          `json:"name"`
	Replica bool            `json:"replica,omitempty"`
	Spec    json.RawMessage `json:"spec,omitempty"`
}

type wireLedger struct {
	Networks map[string]wireKnown `json:"networks"`
	Creating map[string]int64     `json:"creating,omitempty"`
	Removing []string             `json:"removing,omitempty"`
}

func encodeLedger(l Ledger) ([]byte, error) {
	w := wireLedger{Networks: map[string]wireKnown{}, Creating: map[string]int64{}}
	for id, k := range l.Networks {
		wk := wireKnown{Name: k.Name, Replica: k.Replica}
		if k.HasSpec {
			b, err := k.Spec.Encode()
			if err != nil {
				return nil, err
			}
			wk.Spec = b
		}
		w.Networks[id] = wk
	}
	for name, t := range l.Creating {
		w.Creating[name] = t.UnixNano()
	}
	for id := range l.Removing {
		w.Removing = append(w.Removing, id)
	}
	slices.Sort(w.Removing)
	return json.Marshal(&w)
}

func decodeLedger(b []byte) (Ledger, error) {
	var w wireLedger
	if err := json.Unmarshal(b, &w); err != nil {
		return Ledger{}, err
	}
	l := NewLedger()
	for id, wk := range w.Networks {
		k := Known{Name: wk.Name, Replica: wk.Replica}
		if len(wk.Spec) > 0 {
			sp, err := netspec.Decode(wk.Spec)
			if err != nil {
				return Ledger{}, fmt.Errorf("network %s: %w", id, err)
			}
			k.Spec, k.HasSpec = sp, true
		}
		l.Networks[id] = k
	}
	for name, t := range w.Creating {
		l.Creating[name] = time.Unix(0, t)
	}
	for _, id := range w.Removing {
		l.Removing[id] = true
	}
	return l, nil
}
