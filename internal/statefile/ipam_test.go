package statefile

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// openNew opens a new state file in a temporary directory.
func openNew(t *testing.T) (*File, string) {
	t.Helper()
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	return s, dir
}

func TestIPAMRoundTrip(t *testing.T) {
	s, dir := openNew(t)
	if err := s.WriteIPAM(map[string][]byte{"host": []byte("h1"), "pool/a": []byte("ring"), "alloc/a/1": []byte("m1")}); err != nil {
		t.Fatal(err)
	}
	// nil deletes; an empty (non-nil) value is a value.
	if err := s.WriteIPAM(map[string][]byte{"alloc/a/1": nil, "alloc/a/2": {}}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.LoadIPAM()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{"host": []byte("h1"), "pool/a": []byte("ring"), "alloc/a/2": {}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("ipam table after reopen: %q, want %q", got, want)
	}
	if err := s.WriteIPAM(map[string][]byte{"": []byte("x")}); err == nil || !strings.Contains(err.Error(), "empty key") {
		t.Fatalf("empty key: %v", err)
	}
}

// A version 1 file (before the ipam table) gains the table and the new
// version when opened; a version 2 file without it is corrupt (covered by
// TestLostStateRefusesToStart).
func TestIPAMUpgradeFromSchema1(t *testing.T) {
	s, dir := openNew(t)
	if err := s.PutNetwork(Network{ID: "n1", VNIs: []uint32{5}}); err != nil {
		t.Fatal(err)
	}
	if err := s.update("x", func(tx *txAlias) error {
		if err := tx.DeleteBucket(bucketIPAM); err != nil {
			return err
		}
		return tx.Bucket(bucketMeta).Put(keySchema, []byte("1"))
	}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s, err := Open(dir)
	if err != nil {
		t.Fatalf("a version 1 file was refused: %v", err)
	}
	defer s.Close()
	if got, err := s.LoadIPAM(); err != nil || len(got) != 0 {
		t.Fatalf("ipam table of an upgraded file: %v, %v", got, err)
	}
	if st, err := s.Load(); err != nil || len(st.Networks) != 1 {
		t.Fatalf("networks after the upgrade: %+v, %v", st, err)
	}
	var ver []byte
	s.view(func(tx *txAlias) error { ver = append(ver, tx.Bucket(bucketMeta).Get(keySchema)...); return nil })
	if string(ver) != fmt.Sprint(SchemaVersion) {
		t.Fatalf("schema after the upgrade %q, want %d", ver, SchemaVersion)
	}
}

// Concurrent writers on the real file: everything lands, and the writes
// share transactions.
func TestIPAMConcurrentWritersAllLand(t *testing.T) {
	s, _ := openNew(t)
	defer s.Close()
	const writers = 64
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for i := range writers {
		wg.Go(func() {
			errs <- s.WriteIPAM(map[string][]byte{fmt.Sprintf("k%03d", i): []byte(fmt.Sprint(i))})
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.LoadIPAM()
	if err != nil || len(got) != writers {
		t.Fatalf("%d records after %d writers (%v)", len(got), writers, err)
	}
	if tx, calls := s.IPAMCommits(); calls != writers || tx > calls {
		t.Fatalf("commits: %d transactions for %d calls", tx, calls)
	}
}

// The group commit, deterministically: while the first transaction is held
// on disk, every other writer queues; they all go in the second one, in the
// order they queued, and a failed transaction fails every call in it.
func TestGroupCommitCoalesces(t *testing.T) {
	var g groupCommit
	g.init()
	release := make(chan struct{})
	var mu sync.Mutex
	var batches [][]map[string][]byte
	fail := errors.New("disk full")
	commit := func(b []map[string][]byte) error {
		mu.Lock()
		batches = append(batches, b)
		n := len(batches)
		mu.Unlock()
		if n == 1 {
			<-release
			return nil
		}
		return fail
	}
	first := make(chan error, 1)
	go func() { first <- g.write(map[string][]byte{"first": nil}, commit) }()
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(batches) == 1 })
	const others = 10
	errs := make(chan error, others)
	for i := range others {
		go func() { errs <- g.write(map[string][]byte{fmt.Sprint(i): nil}, commit) }()
	}
	waitFor(t, func() bool { g.mu.Lock(); defer g.mu.Unlock(); return len(g.queue) == others })
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range others {
		if err := <-errs; !errors.Is(err, fail) {
			t.Fatalf("a write of the failed transaction returned %v", err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(batches) != 2 || len(batches[1]) != others {
		t.Fatalf("want 2 transactions, the second with %d writes; got %d transactions", others, len(batches))
	}
	if tx, calls := g.transactions, g.calls; tx != 2 || calls != others+1 {
		t.Fatalf("counters: %d transactions, %d calls", tx, calls)
	}
	if g.leading {
		t.Fatal("the commit still has a leader after the queue emptied")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 5 s")
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkWriteIPAM: one small durable write at a time (what a lone
// allocation costs in disk time), with p50/p99.
func BenchmarkWriteIPAM(b *testing.B) {
	s, err := Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	var lat []time.Duration
	i := 0
	for b.Loop() {
		start := time.Now()
		if err := s.WriteIPAM(map[string][]byte{fmt.Sprintf("alloc:%d", i): []byte(`{"mac":"02:42:00:00:00:01","at":1}`)}); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		i++
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[(len(lat)-1)*99/100].Microseconds()), "p99-µs")
}
