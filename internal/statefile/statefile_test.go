package statefile

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := Network{ID: "n1", VNIs: []uint32{5, 6}, Pools: []string{"192.0.2.0/24", "198.51.100.0/24"}, Gateways: []string{"192.0.2.1/24", ""}, MTU: 1450, Options: map[string]string{"vni": "5,6"}}
	e1 := Endpoint{Network: "n1", ID: "e1", Addr: "192.0.2.2/24", MAC: "02:42:c0:00:02:02", Joined: true, HostName: "ovdx", SandboxName: "ovsx"}
	e2 := Endpoint{Network: "n1", ID: "e2", Addr: "192.0.2.3/24", MAC: "02:42:c0:00:02:03"}
	other := Endpoint{Network: "n10", ID: "e1", Addr: "203.0.113.9/24"}
	n10 := Network{ID: "n10", VNIs: []uint32{7}, Pools: []string{"203.0.113.0/24"}, Gateways: []string{""}, MTU: 1450}
	for _, err := range []error{s.PutNetwork(n), s.PutNetwork(n10), s.PutEndpoint(e1), s.PutEndpoint(e2), s.PutEndpoint(other), s.PutAllocation("swarm", []uint32{4096}),
		s.PutMeta("node", []byte("host-a"))} {
		if err != nil {
			t.Fatal(err)
		}
	}
	s.Close()
	s, err = Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	st, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Networks) != 2 || !reflect.DeepEqual(st.Networks[0], n) {
		t.Fatalf("networks %+v", st.Networks)
	}
	if len(st.Endpoints) != 3 || !reflect.DeepEqual(st.Endpoints[0], e1) {
		t.Fatalf("endpoints %+v", st.Endpoints)
	}
	if !reflect.DeepEqual(st.Allocations["swarm"], []uint32{4096}) {
		t.Fatalf("allocations %v", st.Allocations)
	}
	if v, _ := s.GetMeta("node"); string(v) != "host-a" {
		t.Fatalf("meta %q", v)
	}
	// Deleting a network removes its endpoints, not those of n10.
	if err := s.DeleteNetwork("n1"); err != nil {
		t.Fatal(err)
	}
	st, _ = s.Load()
	if len(st.Networks) != 1 || len(st.Endpoints) != 1 || st.Endpoints[0].Network != "n10" {
		t.Fatalf("after delete: %+v", st)
	}
	if err := s.PutAllocation("swarm", nil); err != nil {
		t.Fatal(err)
	}
	if st, _ = s.Load(); len(st.Allocations) != 0 {
		t.Fatalf("allocation not removed: %v", st.Allocations)
	}
}

func TestCorruptFileRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, FileName), []byte(strings.Repeat("garbage!", 1024)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Open(dir)
	var ce *CorruptError
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "mv ") || !strings.Contains(err.Error(), "refuses to start") {
		t.Fatalf("corrupt file: %v", err)
	}
}

func TestCorruptRecordRefusesToLoad(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.update("x", func(tx *txAlias) error { return tx.Bucket(bucketNetworks).Put([]byte("bad"), []byte("{")) }); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Load(); err == nil || !strings.Contains(err.Error(), `network "bad"`) {
		t.Fatalf("corrupt record: %v", err)
	}
}

func TestLockedByAnotherProcess(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "locked by another process") {
		t.Fatalf("second open: %v", err)
	}
}

func TestNewerSchemaRefused(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	s.update("x", func(tx *txAlias) error { return tx.Bucket(bucketMeta).Put(keySchema, []byte("99")) })
	s.Close()
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "schema version 99") {
		t.Fatalf("newer schema: %v", err)
	}
}

// Only a missing file is a fresh start: an empty file, a file whose tables
// or schema version are gone, and endpoint records of a network the file
// does not hold all stop the start with the recovery message.
func TestLostStateRefusesToStart(t *testing.T) {
	recovery := func(t *testing.T, err error, what string) {
		t.Helper()
		var ce *CorruptError
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), what) || !strings.Contains(err.Error(), "mv ") {
			t.Fatalf("want a CorruptError naming %q with the recovery steps, got %v", what, err)
		}
	}
	t.Run("empty file", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, FileName), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := Open(dir)
		recovery(t, err, "empty")
	})
	for _, table := range [][]byte{bucketNetworks, bucketEndpoints, bucketAllocs, bucketMeta, bucketIPAM} {
		t.Run("missing table "+string(table), func(t *testing.T) {
			dir := t.TempDir()
			s, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.update("x", func(tx *txAlias) error { return tx.DeleteBucket(table) }); err != nil {
				t.Fatal(err)
			}
			s.Close()
			_, err = Open(dir)
			recovery(t, err, string(table))
		})
	}
	t.Run("missing schema", func(t *testing.T) {
		dir := t.TempDir()
		s, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		s.update("x", func(tx *txAlias) error { return tx.Bucket(bucketMeta).Delete(keySchema) })
		s.Close()
		_, err = Open(dir)
		recovery(t, err, "schema version is missing")
	})
	t.Run("endpoint of a missing network", func(t *testing.T) {
		dir := t.TempDir()
		s, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := s.PutEndpoint(Endpoint{Network: "gone", ID: "e1", Addr: "192.0.2.2/24"}); err != nil {
			t.Fatal(err)
		}
		_, err = s.Load()
		recovery(t, err, `network "gone"`)
	})
}

// TestUpdateMeta: several meta records written and deleted in one
// transaction survive a reopen; a reserved key fails the whole update;
// ListMeta returns exactly the keys under its prefix.
func TestUpdateMeta(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.UpdateMeta(map[string][]byte{"enc": []byte("core"), "enc/r/a": []byte("1"), "enc/r/b": []byte("2"), "encx": []byte("other")}); err != nil {
		t.Fatal(err)
	}
	if err := s.UpdateMeta(map[string][]byte{"enc/r/a": nil, "enc/r/c": []byte("3")}); err != nil {
		t.Fatal(err)
	}
	if err := s.UpdateMeta(map[string][]byte{"enc/r/d": []byte("4"), string(keySchema): []byte("9")}); err == nil || !strings.Contains(err.Error(), "reserved") {
		t.Fatalf("an update with the schema key: %v, want refused", err)
	}
	s.Close()
	if s, err = Open(dir); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.ListMeta("enc/r/")
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string][]byte{"enc/r/b": []byte("2"), "enc/r/c": []byte("3")}; !reflect.DeepEqual(got, want) {
		t.Fatalf("ListMeta = %q, want %q (the refused update wrote nothing)", got, want)
	}
	if v, _ := s.GetMeta("enc"); string(v) != "core" {
		t.Fatalf("core = %q", v)
	}
}

// BenchmarkOpen: opening a file of 10,000 endpoints, which reads every
// page of it.
func BenchmarkOpen(b *testing.B) {
	dir := b.TempDir()
	s, err := Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	if err := s.PutNetwork(Network{ID: "n1", VNIs: []uint32{5}}); err != nil {
		b.Fatal(err)
	}
	if err := s.update("endpoints", func(tx *txAlias) error {
		for i := range 10000 {
			if err := put(tx, bucketEndpoints, epKey("n1", fmt.Sprintf("e%05d", i)), Endpoint{Network: "n1", ID: fmt.Sprintf("e%05d", i), Addr: "192.0.2.3/24", MAC: "02:42:c0:00:02:03"}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	s.Close()
	for b.Loop() {
		s, err := Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		s.Close()
	}
	fi, err := os.Stat(filepath.Join(dir, FileName))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(fi.Size())/1024, "file-KiB")
}
