package ipam

import (
	"maps"
	"testing"
)

// Every bad input gets an error naming the field and what is allowed, and
// leaves the state file as it was.
func TestBadInput(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	a, b := c.hosts["node-a"], c.hosts["node-b"]
	poolID := a.requestPool(t, "198.51.100.0/24", "198.51.100.128/25")
	b.requestPool(t, "198.51.100.0/24", "198.51.100.128/25")
	// node-b uses 203.0.113.0/24; node-a hears of it through gossip.
	b.requestPool(t, "203.0.113.0/24", "")
	waitUntil(t, 5e9, "node-a hears that node-b uses 203.0.113.0/24", func() bool {
		p := a.a.lookupPool("overlayd:203.0.113.0/24")
		if p == nil {
			return false
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		for id, r := range p.reports {
			if id.Name == "node-b" && r.stats.inUse {
				return true
			}
		}
		return false
	})
	if _, err := a.request(ctxT(t), poolID, "198.51.100.130", mac(1, 1)); err != nil {
		t.Fatal(err)
	}
	store := a.store.(*memStore)

	pools := []struct {
		name string
		req  PoolRequest
		want []string
	}{
		{"v6", PoolRequest{Pool: "2001:db8::/64", V6: true}, []string{"V6", "IPv4 pools only"}},
		{"no subnet", PoolRequest{}, []string{"Pool", "--subnet is required with --ipam-driver overlayd", "same subnet"}},
		{"garbage subnet", PoolRequest{Pool: "198.51.100.0"}, []string{`Pool "198.51.100.0" is not a subnet in CIDR form`}},
		{"v6 subnet without the flag", PoolRequest{Pool: "2001:db8::/64"}, []string{"Pool (--subnet) 2001:db8::/64 is not IPv4"}},
		{"host bits", PoolRequest{Pool: "198.51.100.1/24"}, []string{"Pool (--subnet) 198.51.100.1/24 has host bits set", "198.51.100.0/24"}},
		{"too small", PoolRequest{Pool: "192.0.2.0/31"}, []string{"Pool (--subnet) 192.0.2.0/31 is too small", "/30"}},
		{"range garbage", PoolRequest{Pool: "192.0.2.0/24", SubPool: "x"}, []string{`SubPool (--ip-range) "x" is not a range`}},
		{"range outside", PoolRequest{Pool: "192.0.2.0/24", SubPool: "198.51.100.0/25"}, []string{"SubPool (--ip-range) 198.51.100.0/25 is not inside Pool (--subnet) 192.0.2.0/24"}},
		{"range wider", PoolRequest{Pool: "192.0.2.0/25", SubPool: "192.0.2.0/24"}, []string{"SubPool (--ip-range) 192.0.2.0/24 is not inside"}},
		{"range host bits", PoolRequest{Pool: "192.0.2.0/24", SubPool: "192.0.2.1/25"}, []string{"SubPool (--ip-range) 192.0.2.1/25 has host bits set"}},
		{"range without addresses", PoolRequest{Pool: "192.0.2.0/24", SubPool: "192.0.2.0/31"}, []string{"SubPool (--ip-range) 192.0.2.0/31 has no address to hand out", "gateway (192.0.2.1)"}},
		{"address space", PoolRequest{AddressSpace: "LocalDefault", Pool: "192.0.2.0/24"}, []string{`AddressSpace "LocalDefault" is not overlayd's`}},
		{"overlap here", PoolRequest{Pool: "198.51.100.0/23"}, []string{"Pool 198.51.100.0/23 overlaps pool " + poolID + ", which a network of this host uses"}},
		{"overlap other range", PoolRequest{Pool: "198.51.100.0/24"}, []string{"overlaps pool " + poolID}},
		{"overlap elsewhere", PoolRequest{Pool: "203.0.113.128/25"}, []string{"Pool 203.0.113.128/25 overlaps pool overlayd:203.0.113.0/24, which networks on node-b use"}},
	}
	unchanged := func(t *testing.T, what string, f func()) {
		t.Helper()
		before := snapshot(store)
		f()
		if err := a.a.journal.sync(); err != nil {
			t.Fatal(err)
		}
		if after := snapshot(store); !maps.EqualFunc(before, after, func(x, y []byte) bool { return string(x) == string(y) }) {
			t.Fatalf("%s changed the state file", what)
		}
	}
	for _, tc := range pools {
		t.Run("RequestPool/"+tc.name, func(t *testing.T) {
			unchanged(t, tc.name, func() {
				_, err := a.a.RequestPool(ctxT(t), tc.req)
				wantErr(t, err, tc.want...)
			})
		})
	}
	gw := map[string]string{OptionRequestAddressType: RequestAddressTypeGateway}
	addrs := []struct {
		name string
		req  AddressRequest
		want []string
	}{
		{"pool id prefix", AddressRequest{PoolID: "default:198.51.100.0/24"}, []string{`PoolID "default:198.51.100.0/24" is not one of overlayd's`, "does not start with overlayd:"}},
		{"pool id subnet", AddressRequest{PoolID: "overlayd:x"}, []string{`PoolID "overlayd:x"`, "the subnet does not parse"}},
		{"pool id range", AddressRequest{PoolID: "overlayd:198.51.100.0/24:y"}, []string{"the range does not parse"}},
		{"pool id not canonical", AddressRequest{PoolID: "overlayd:198.51.100.0/24:198.51.100.0/24"}, []string{"the range equals the subnet"}},
		{"pool id host bits", AddressRequest{PoolID: "overlayd:198.51.100.5/24"}, []string{"PoolID's subnet 198.51.100.5/24 has host bits set"}},
		{"pool not requested", AddressRequest{PoolID: "overlayd:192.0.2.0/24"}, []string{"PoolID overlayd:192.0.2.0/24 was not requested on this host (RequestPool first)"}},
		{"address garbage", AddressRequest{PoolID: poolID, Address: "300.1.1.1"}, []string{`Address "300.1.1.1" is not an IPv4 address`}},
		{"address v6", AddressRequest{PoolID: poolID, Address: "2001:db8::1"}, []string{`Address "2001:db8::1" is not an IPv4 address`}},
		{"outside subnet", AddressRequest{PoolID: poolID, Address: "192.0.2.9"}, []string{"Address 192.0.2.9 is outside the pool's subnet 198.51.100.0/24"}},
		{"network", AddressRequest{PoolID: poolID, Address: "198.51.100.0"}, []string{"Address 198.51.100.0 is the subnet's network address"}},
		{"broadcast", AddressRequest{PoolID: poolID, Address: "198.51.100.255"}, []string{"Address 198.51.100.255 is the subnet's broadcast address"}},
		{"gateway", AddressRequest{PoolID: poolID, Address: "198.51.100.1"}, []string{"Address 198.51.100.1 is the pool's gateway"}},
		{"outside range", AddressRequest{PoolID: poolID, Address: "198.51.100.9"}, []string{"Address 198.51.100.9 is outside the pool's range 198.51.100.128/25 (--ip-range)"}},
		{"other gateway", AddressRequest{PoolID: poolID, Address: "198.51.100.254", Options: gw}, []string{"Address 198.51.100.254: the gateway of an overlayd pool is always the subnet's first address, 198.51.100.1"}},
		{"bad mac", AddressRequest{PoolID: poolID, Options: map[string]string{OptionMACAddress: "02:42"}}, []string{"option " + OptionMACAddress, `"02:42" is not a 48-bit MAC address`}},
		{"long mac", AddressRequest{PoolID: poolID, Options: map[string]string{OptionMACAddress: "00:00:00:00:fe:80:00:00:00:00:00:00:02:00:5e:10:00:00:00:01"}}, []string{"is not a 48-bit MAC address"}},
		{"address type", AddressRequest{PoolID: poolID, Options: map[string]string{OptionRequestAddressType: "x"}}, []string{`option RequestAddressType="x" is not known`}},
		{"in use here", AddressRequest{PoolID: poolID, Address: "198.51.100.130", Options: map[string]string{OptionMACAddress: mac(9, 9)}}, []string{"198.51.100.130 is in use on this host"}},
	}
	for _, tc := range addrs {
		t.Run("RequestAddress/"+tc.name, func(t *testing.T) {
			unchanged(t, tc.name, func() {
				_, err := a.a.RequestAddress(ctxT(t), tc.req)
				wantErr(t, err, tc.want...)
				want := ReasonBadInput
				if tc.name == "in use here" {
					want = ReasonInUse
				}
				wantReason(t, err, want)
			})
		})
	}
	releases := []struct {
		name, pool, addr string
		want             []string
	}{
		{"bad pool", "overlayd:nope", "198.51.100.130", []string{`PoolID "overlayd:nope"`}},
		{"garbage", poolID, "x", []string{`Address "x" is not an IPv4 address`}},
		{"outside", poolID, "192.0.2.1", []string{"Address 192.0.2.1 is outside the pool's subnet"}},
		{"not allocated", poolID, "198.51.100.131", []string{"Address 198.51.100.131 is not allocated on this host"}},
		{"unknown pool", "overlayd:192.0.2.0/24", "192.0.2.5", []string{"Address 192.0.2.5 is not allocated on this host (PoolID overlayd:192.0.2.0/24 was not requested here)"}},
	}
	for _, tc := range releases {
		t.Run("ReleaseAddress/"+tc.name, func(t *testing.T) {
			unchanged(t, tc.name, func() {
				err := a.a.ReleaseAddress(ctxT(t), tc.pool, tc.addr)
				wantErr(t, err, tc.want...)
				wantReason(t, err, ReasonBadInput)
			})
		})
	}
	t.Run("ReleasePool/unknown", func(t *testing.T) {
		unchanged(t, "ReleasePool", func() {
			wantErr(t, a.a.ReleasePool(ctxT(t), "overlayd:192.0.2.0/24"), "PoolID overlayd:192.0.2.0/24 is not in use on this host")
		})
	})
	// The address dockerd gives with a prefix length is accepted.
	if err := a.a.ReleaseAddress(ctxT(t), poolID, "198.51.100.130/24"); err != nil {
		t.Fatal(err)
	}
}

func snapshot(s *memStore) map[string][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.data)
}

// A write that fails fails the request, which leaves nothing behind: the
// address is not handed out, and is free once the disk works again.
func TestWriteFailureFailsTheRequest(t *testing.T) {
	c := newCluster(t, "node-a")
	a := c.hosts["node-a"]
	poolID := a.requestPool(t, "192.0.2.0/29", "")
	store := a.store.(*memStore)
	store.setFailing(errDisk)
	_, err := a.request(ctxT(t), poolID, "", mac(1, 1))
	wantErr(t, err, "failed to record", "disk on fire")
	if n := len(a.allocations(poolID)); n != 0 {
		t.Fatalf("%d allocations after a failed write", n)
	}
	store.setFailing(nil)
	got, err := a.request(ctxT(t), poolID, "", mac(1, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.a.journal.sync(); err != nil {
		t.Fatal(err)
	}
	snap := snapshot(store)
	if len(snap) == 0 {
		t.Fatal("nothing on disk")
	}
	var allocs []string
	for k := range snap {
		if len(k) > len(prefixAlloc) && k[:len(prefixAlloc)] == prefixAlloc {
			allocs = append(allocs, k)
		}
	}
	if len(allocs) != 1 || allocs[0] != allocKey(poolID, u32(got.Addr())) {
		t.Fatalf("allocation records on disk %v, want only %s", allocs, got)
	}
}
