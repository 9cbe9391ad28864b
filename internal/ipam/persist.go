package ipam

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// Keys of the ipam table. Pool IDs hold ':' and '/', never '@'.
const (
	keyHost         = "host"       // this host's identity
	prefixPool      = "pool:"      // + PoolID: ring and use count
	prefixAlloc     = "alloc:"     // + PoolID + "@" + address: an allocation
	prefixClaim     = "claim:"     // + PoolID: this host's pending claim
	prefixVote      = "vote:"      // + PoolID: the claim this host accepted
	prefixReclaimed = "reclaimed:" // + identity: reclaimed, by whom
)

func allocKey(pool string, a uint32) string { return prefixAlloc + pool + "@" + addrOf(a).String() }

type hostRecord struct {
	Name string `json:"name"`
	ID   string `json:"id"` // 16 hex digits
}

type poolRecord struct {
	Refs int `json:"refs"`
	// Ring: [start, owner identity, version] per token; absent until the
	// ring is known.
	Ring [][3]any `json:"ring,omitempty"`
}

type allocRecord struct {
	MAC string `json:"mac,omitempty"`
	At  int64  `json:"at"`
}

type claimRecord struct {
	Proposer string `json:"proposer"`
	Nonce    string `json:"nonce"`
}

type reclaimRecord struct {
	By string `json:"by"`
	At int64  `json:"at"`
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("ipam: marshal %T: %v", v, err)) // only our own plain structs
	}
	return b
}

func encodePoolRecord(refs int, r *ring) []byte {
	rec := poolRecord{Refs: refs}
	if r != nil {
		rec.Ring = make([][3]any, len(r.tokens))
		for i, t := range r.tokens {
			rec.Ring[i] = [3]any{addrOf(t.start).String(), t.owner.String(), t.version}
		}
	}
	return mustJSON(rec)
}

func decodePoolRecord(s poolSpec, b []byte) (refs int, r *ring, err error) {
	var rec struct {
		Refs int                  `json:"refs"`
		Ring [][3]json.RawMessage `json:"ring"`
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return 0, nil, err
	}
	if rec.Refs < 0 {
		return 0, nil, fmt.Errorf("use count %d", rec.Refs)
	}
	if rec.Ring == nil {
		return rec.Refs, nil, nil
	}
	r = &ring{lo: s.lo, hi: s.hi, tokens: make([]token, len(rec.Ring))}
	for i, raw := range rec.Ring {
		var start, owner string
		var version uint32
		if err := json.Unmarshal(raw[0], &start); err != nil {
			return 0, nil, fmt.Errorf("token %d start: %w", i, err)
		}
		if err := json.Unmarshal(raw[1], &owner); err != nil {
			return 0, nil, fmt.Errorf("token %d owner: %w", i, err)
		}
		if err := json.Unmarshal(raw[2], &version); err != nil {
			return 0, nil, fmt.Errorf("token %d version: %w", i, err)
		}
		a, err := netip.ParseAddr(start)
		if err != nil || !a.Is4() {
			return 0, nil, fmt.Errorf("token %d start %q is not an IPv4 address", i, start)
		}
		id, err := parseIdentity(owner)
		if err != nil {
			return 0, nil, fmt.Errorf("token %d: %w", i, err)
		}
		r.tokens[i] = token{start: u32(a), owner: id, version: version}
	}
	if err := r.checkLimit(maxWireTokens); err != nil {
		return 0, nil, err
	}
	return rec.Refs, r, nil
}

func encodeAlloc(a allocation) []byte { return mustJSON(allocRecord{MAC: a.macString(), At: a.at}) }

func decodeAlloc(b []byte) (allocation, error) {
	var rec allocRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return allocation{}, err
	}
	a := allocation{at: rec.At}
	if rec.MAC != "" {
		mac, err := parseMAC(rec.MAC)
		if err != nil {
			return allocation{}, err
		}
		a.mac, a.hasMAC = mac, true
	}
	return a, nil
}

// parseMAC accepts a 48-bit MAC in any form net.ParseMAC knows.
func parseMAC(s string) ([6]byte, error) {
	hw, err := net.ParseMAC(s)
	if err != nil || len(hw) != 6 {
		return [6]byte{}, fmt.Errorf("%q is not a 48-bit MAC address (e.g. 02:42:c6:33:64:07)", s)
	}
	return [6]byte(hw), nil
}

func encodeClaim(c claimID) []byte {
	return mustJSON(claimRecord{Proposer: c.proposer.String(), Nonce: strconv.FormatUint(c.nonce, 16)})
}

func decodeClaim(b []byte) (claimID, error) {
	var rec claimRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return claimID{}, err
	}
	p, err := parseIdentity(rec.Proposer)
	if err != nil {
		return claimID{}, err
	}
	n, err := strconv.ParseUint(rec.Nonce, 16, 64)
	if err != nil {
		return claimID{}, fmt.Errorf("nonce %q: %w", rec.Nonce, err)
	}
	return claimID{proposer: p, nonce: n}, nil
}

// splitAllocKey splits "alloc:POOLID@ADDR".
func splitAllocKey(k string) (pool string, addr netip.Addr, err error) {
	rest := strings.TrimPrefix(k, prefixAlloc)
	i := strings.LastIndexByte(rest, '@')
	if i < 0 {
		return "", netip.Addr{}, fmt.Errorf("key %q has no '@'", k)
	}
	addr, err = netip.ParseAddr(rest[i+1:])
	if err != nil || !addr.Is4() {
		return "", netip.Addr{}, fmt.Errorf("key %q: %q is not an IPv4 address", k, rest[i+1:])
	}
	return rest[:i], addr, nil
}

// journal is the allocator's group commit: changes are marked, in the
// order they happen, under the lock of what they change; a caller that
// must not answer before its change is on disk waits for the mark's
// sequence number. One write runs at a time and carries everything marked
// so far (the latest value per key), so the file always holds the state
// after some prefix of the marks, and concurrent requests share a write.
type journal struct {
	store Store
	mu    *lockorder.Mutex // leaf: never held while writing
	// pending: marked, not yet written (nil value: delete); guarded by mu.
	pending map[string][]byte
	// seq: last mark; flushed: last mark on disk; guarded by mu.
	seq, flushed uint64
	// failedUpTo, failErr: the last failed write covered marks up to
	// failedUpTo; guarded by mu.
	failedUpTo uint64
	failErr    error
	// writing: a write runs; done is closed when it ends; guarded by mu.
	writing bool
	done    chan struct{}
	// writes: how many writes ran (for tests and benchmarks); guarded by mu.
	writes uint64
}

func newJournal(s Store) *journal {
	return &journal{store: s, mu: lockorder.New(lockorder.LevelLeaf), pending: map[string][]byte{}}
}

// mark records puts as the latest values of their keys and returns the
// mark's sequence number.
func (j *journal) mark(puts map[string][]byte) uint64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	for k, v := range puts {
		j.pending[k] = v
	}
	j.seq++
	return j.seq
}

// mark1 marks one key.
func (j *journal) mark1(k string, v []byte) uint64 { return j.mark(map[string][]byte{k: v}) }

// wait returns once mark seq is on disk, or the error of the write that
// carried it. Never call it holding an allocator lock.
func (j *journal) wait(seq uint64) error {
	for {
		j.mu.Lock()
		switch {
		case j.flushed >= seq:
			j.mu.Unlock()
			return nil
		case j.failedUpTo >= seq:
			err := j.failErr
			j.mu.Unlock()
			return err
		case j.writing:
			ch := j.done
			j.mu.Unlock()
			<-ch
			continue
		}
		batch, upTo := j.pending, j.seq
		j.pending = map[string][]byte{}
		j.writing, j.done = true, make(chan struct{})
		j.writes++
		j.mu.Unlock()
		err := j.store.WriteIPAM(batch)
		j.mu.Lock()
		if err == nil {
			j.flushed = upTo
		} else {
			j.failedUpTo, j.failErr = upTo, err
			// Keep what failed for the next write, under what was
			// marked since.
			for k, v := range batch {
				if _, newer := j.pending[k]; !newer {
					j.pending[k] = v
				}
			}
		}
		j.writing = false
		close(j.done)
		j.mu.Unlock()
	}
}

// sync writes everything marked so far, retrying what a failed write
// left pending.
func (j *journal) sync() error {
	j.mu.Lock()
	if len(j.pending) > 0 {
		j.seq++ // a mark of its own, so that a failed write is retried
	}
	seq := j.seq
	j.mu.Unlock()
	return j.wait(seq)
}
