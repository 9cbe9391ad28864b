package statefile

import (
	"fmt"

	bolt "go.etcd.io/bbolt"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// The ipam table belongs to internal/ipam (cluster address management): its
// keys and values are opaque here. Its writer answers dockerd only after the
// write is on disk, and many RequestAddress calls run at once, so
// concurrent writes are coalesced into one transaction (one fsync) by a
// group commit: the first writer to find no commit running becomes the
// leader and writes everything queued so far, including what arrives while
// it waits for the lock; the others wait for the commit that carries their
// puts. Nobody waits for a timer (bbolt's Batch waits up to 10 ms for
// company, which a lone allocation would pay in full).

// LoadIPAM returns a copy of the ipam table.
func (s *File) LoadIPAM() (map[string][]byte, error) {
	out := map[string][]byte{}
	err := s.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketIPAM).ForEach(func(k, v []byte) error {
			out[string(k)] = append([]byte{}, v...)
			return nil
		})
	})
	if err != nil {
		return nil, corrupt(s.path, err)
	}
	return out, nil
}

// WriteIPAM stores puts in the ipam table atomically and durably (fsynced
// before it returns); a nil value deletes its key. Concurrent calls share
// one transaction. Puts of one call are applied after those of every call
// that returned before it started; among concurrent calls the order is the
// order in which they queued, so a caller that needs an order between two
// writes of one key must not issue them concurrently. An empty key is
// refused. If the shared transaction fails, every call in it gets the error
// and none of their puts is stored.
func (s *File) WriteIPAM(puts map[string][]byte) error {
	for k := range puts {
		if k == "" {
			return fmt.Errorf("failed to save ipam records to %s: an empty key", s.path)
		}
	}
	if len(puts) == 0 {
		return nil
	}
	return s.ipamCommit.write(puts, func(batch []map[string][]byte) error {
		keys := 0
		for _, p := range batch {
			keys += len(p)
		}
		return s.update(fmt.Sprintf("%d ipam records", keys), func(tx *bolt.Tx) error {
			b := tx.Bucket(bucketIPAM)
			for _, p := range batch {
				if err := putAll(b, "ipam record", p); err != nil {
					return err
				}
			}
			return nil
		})
	})
}

// IPAMCommits returns how many transactions WriteIPAM ran and how many
// calls they carried: the ratio says how well writes coalesce.
func (s *File) IPAMCommits() (transactions, calls uint64) {
	g := &s.ipamCommit
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.transactions, g.calls
}

// groupCommit runs one leader at a time. A leader commits the queue as it
// finds it; if more writes queued meanwhile, the first of them becomes the
// next leader, so no caller carries other callers' writes after its own are
// on disk.
type groupCommit struct {
	mu *lockorder.Mutex // leaf: never held while a transaction runs
	// queue: calls waiting for the next transaction; guarded by mu.
	queue []*pendingWrite
	// leading: a leader is running a transaction; guarded by mu.
	leading bool
	// transactions, calls: counters for IPAMCommits; guarded by mu.
	transactions, calls uint64
}

type pendingWrite struct {
	puts map[string][]byte
	// done receives the commit's result, or lead: this call is the next
	// leader. Buffered: a leader never waits for a writer.
	done chan commitResult
}

type commitResult struct {
	err  error
	lead bool
}

func (g *groupCommit) init() { g.mu = lockorder.New(lockorder.LevelLeaf) }

func (g *groupCommit) write(puts map[string][]byte, commit func([]map[string][]byte) error) error {
	me := &pendingWrite{puts: puts, done: make(chan commitResult, 1)}
	g.mu.Lock()
	g.queue = append(g.queue, me)
	if g.leading {
		g.mu.Unlock()
		r := <-me.done
		if !r.lead {
			return r.err
		}
		g.mu.Lock()
	}
	// Leader: g.leading is set (by this call or handed over), mu held.
	g.leading = true
	batch := g.queue
	g.queue = nil
	g.transactions++
	g.calls += uint64(len(batch))
	g.mu.Unlock()
	maps := make([]map[string][]byte, len(batch))
	for i, w := range batch {
		maps[i] = w.puts
	}
	err := commit(maps)
	for _, w := range batch {
		if w != me {
			w.done <- commitResult{err: err}
		}
	}
	g.mu.Lock()
	if len(g.queue) > 0 {
		g.queue[0].done <- commitResult{lead: true}
	} else {
		g.leading = false
	}
	g.mu.Unlock()
	return err
}
