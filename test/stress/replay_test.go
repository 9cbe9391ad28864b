//go:build testhooks

package stress

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/peerdb"
)

// Sequential replay: a run's trace file holds every state change the driver
// made, in the order it linearised them, each pull with the records it read
// from the source. Replaying it one call at a time on a fresh driver (a
// pull: the source is given the records the original pull read, then told
// PeersChanged) must produce the same states; checking the oracle after
// every call finds the first call after which kernel and model differ, and
// replaying only the events of the networks involved shrinks the log.
//
// The replay's encryption owner has no keys (it is attached to no gossip):
// every policy points at no SA; tables, sets and policies are checked as in
// a run.

// TestReplay replays OVERLAYD_REPLAY=<trace file> (printed by a failing run).
func TestReplay(t *testing.T) {
	path := os.Getenv("OVERLAYD_REPLAY")
	if path == "" {
		t.Skip("set OVERLAYD_REPLAY=<trace file of a failing run>")
	}
	evs, err := readTrace(path)
	if err != nil {
		t.Fatal(err)
	}
	res := replayAndShrink(t, evs, 2*time.Minute)
	if res.at < 0 {
		t.Logf("%d events replayed sequentially without divergence: the failure needs concurrency (or a fault that is not active)", len(evs))
		return
	}
	t.Fatal(res.report)
}

func readTrace(path string) ([]tev, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var r io.Reader = f
	if strings.HasSuffix(path, ".gz") {
		gz, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		r = gz
	}
	var evs []tev
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var ev tev
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		evs = append(evs, ev)
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, fmt.Errorf("%s: %w", path, err) // a cut-off stream ends the trace
	}
	return evs, nil
}

type replayResult struct {
	at     int      // index of the first event after which a check failed; -1 if none
	diffs  []string // the differences there
	log    []tev
	report string
}

// replayAndShrink replays evs, checking after every event; on a divergence
// it tries to reproduce it with only the events of the networks involved,
// then drops chunks of events while it still reproduces (within budget).
func replayAndShrink(t *testing.T, evs []tev, budget time.Duration) replayResult {
	var first replayResult
	t.Run("full", func(t *testing.T) { first = replay(t, evs, true) })
	if first.at < 0 {
		return first
	}
	deadline := time.Now().Add(budget)
	best := evs[:first.at+1]
	bestDiffs := first.diffs
	if sliced := sliceForNetworks(best, first.diffs); len(sliced) < len(best) {
		var r replayResult
		t.Run("sliced", func(t *testing.T) { r = replay(t, sliced, false) })
		if r.at >= 0 {
			best, bestDiffs = sliced, r.diffs
		}
	}
	// Greedy chunk removal, coarse to fine; a candidate counts if the final
	// check still differs (calls that fail because their preconditions were
	// removed make the candidate invalid).
	for chunk := len(best) / 2; chunk >= 1 && time.Now().Before(deadline); chunk /= 2 {
		for start := 0; start+chunk <= len(best) && time.Now().Before(deadline); {
			cand := append(slices.Clone(best[:start]), best[start+chunk:]...)
			var r replayResult
			t.Run(fmt.Sprintf("shrink-%d", len(cand)), func(t *testing.T) { r = replay(t, cand, false) })
			if r.at >= 0 {
				best, bestDiffs = cand, r.diffs
			} else {
				start += chunk
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "sequential replay diverges after event #%d of %d; a log of %d events that reproduces it (sequentially, on a fresh driver):\n",
		first.at, len(evs), len(best))
	for i, ev := range best {
		fmt.Fprintf(&b, "  %d. %s\n", i+1, fmtTrace(ev))
	}
	fmt.Fprintf(&b, "differences after the last one:\n")
	for _, d := range bestDiffs {
		fmt.Fprintf(&b, "  %s\n", d)
	}
	return replayResult{at: first.at, diffs: bestDiffs, log: best, report: b.String()}
}

// replay issues evs one by one on a fresh driver. With everyStep it checks
// after each event (and returns the first that diverges); otherwise only at
// the end. A call that fails where the original succeeded makes the log
// invalid (at = -1), unless everyStep, where that is itself a divergence.
func replay(t *testing.T, evs []tev, everyStep bool) replayResult {
	e := newEnv(t, true, true, false)
	m := newModel()
	check := func(i int) []string {
		var diffs []string
		got, _ := e.rec.take()
		for _, ev := range got {
			if err := m.apply(ev); err != nil {
				diffs = append(diffs, "trace: "+err.Error())
			}
		}
		m.syncRemotes(e.src.snapshot())
		// The model is the state once Leave's handed-over deletions are
		// done, as at the harness's quiet points: without waiting, a
		// Leave's veth or sandbox still in the kernel reads as a
		// divergence and the shrinker chases it instead of the real one.
		e.d.WaitDeletions()
		diffs = append(diffs, compareAll(e, m, nil, nil)...)
		for _, l := range e.logs.take() {
			diffs = append(diffs, "logged: "+l)
		}
		return diffs
	}
	for i, ev := range evs {
		if err := issue(e, ev); err != nil {
			if !everyStep {
				return replayResult{at: -1}
			}
			return replayResult{at: i, diffs: []string{fmt.Sprintf("replaying %s failed: %v", fmtTrace(ev), err)}}
		}
		if everyStep || i == len(evs)-1 {
			if diffs := check(i); len(diffs) > 0 {
				return replayResult{at: i, diffs: diffs}
			}
		}
	}
	return replayResult{at: -1}
}

// issue makes the call that produced ev; for a pull, it first gives the
// source the records the original pull read.
func issue(e *env, ev tev) error {
	d := e.d
	switch ev.Kind {
	case driver.TraceCreateNetwork:
		vnis := make([]string, len(ev.VNIs))
		for i, v := range ev.VNIs {
			vnis[i] = strconv.FormatUint(uint64(v), 10)
		}
		generic := map[string]interface{}{driver.OptVNI: strings.Join(vnis, ","), driver.OptMTU: strconv.Itoa(ev.MTU)}
		if ev.Encrypted {
			generic[driver.OptEncrypted] = ""
		}
		req := &api.CreateNetworkRequest{NetworkID: ev.Network, Options: map[string]interface{}{
			driver.OptGeneric:  generic,
			driver.OptInternal: ev.Internal,
		}}
		for i, p := range ev.Pools {
			if !p.Addr().Is4() {
				continue // an IPv6-only segment (its IPv6 subnets follow)
			}
			data := &api.IPAMData{AddressSpace: "GlobalDefault", Pool: p.String()}
			if i < len(ev.Gateways) && ev.Gateways[i].IsValid() {
				data.Gateway = ev.Gateways[i].String()
			}
			req.IPv4Data = append(req.IPv4Data, data)
		}
		for _, p := range ev.Pools {
			if p.Addr().Is4() {
				continue
			}
			data := &api.IPAMData{AddressSpace: "GlobalDefault", Pool: p.String()}
			if j := len(req.IPv6Data); j < len(ev.SpecGateways6) && ev.SpecGateways6[j].IsValid() {
				data.Gateway = ev.SpecGateways6[j].String()
			}
			req.IPv6Data = append(req.IPv6Data, data)
			req.Options[driver.OptEnableV6] = true
		}
		return d.CreateNetwork(req)
	case driver.TraceDeleteNetwork:
		return d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: ev.Network})
	case driver.TraceCreateEndpoint:
		iface := &api.EndpointInterface{MacAddress: ev.MAC.String()}
		if ev.Addr.Addr().Is4() {
			iface.Address = ev.Addr.String()
		}
		if ev.SpecAddr6.IsValid() {
			iface.AddressIPv6 = ev.SpecAddr6.String()
		}
		_, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: ev.Network, EndpointID: ev.Endpoint, Interface: iface})
		return err
	case driver.TraceDeleteEndpoint:
		return d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: ev.Network, EndpointID: ev.Endpoint})
	case driver.TraceJoin:
		_, err := d.Join(&api.JoinRequest{NetworkID: ev.Network, EndpointID: ev.Endpoint})
		return err
	case driver.TraceLeave:
		return d.Leave(&api.LeaveRequest{NetworkID: ev.Network, EndpointID: ev.Endpoint})
	case driver.TracePull:
		keys := []peerdb.Key{}
		e.src.mutate(func() {
			if ev.Full {
				for _, k := range e.src.keysLocked(ev.VNI) {
					e.src.delLocked(k)
				}
			}
			for _, r := range ev.Read {
				keys = append(keys, r.Key)
				if r.Peer != nil {
					e.src.setLocked(r.Key, *r.Peer)
				} else {
					e.src.delLocked(r.Key)
				}
			}
		})
		if ev.Full {
			keys = nil
		}
		d.PeersChanged(ev.VNI, keys)
		return nil
	}
	return fmt.Errorf("unknown trace event %v", ev.Kind)
}

// sliceForNetworks keeps the events of the networks the differences name
// and of every network sharing a VNI with them (one's records are the
// other's once it is deleted: they stay at the source), their pulls
// included.
func sliceForNetworks(evs []tev, diffs []string) []tev {
	nets := map[string]bool{}
	all := map[string]bool{}
	for _, ev := range evs {
		if ev.Network != "" {
			all[ev.Network] = true
		}
	}
	for _, d := range diffs {
		for _, w := range idWord.FindAllString(d, -1) {
			if all[w] {
				nets[w] = true
			}
		}
	}
	if len(nets) == 0 {
		return evs
	}
	vnis := map[uint32]bool{}
	for changed := true; changed; {
		changed = false
		for _, ev := range evs {
			if ev.Kind != driver.TraceCreateNetwork {
				continue
			}
			hit := nets[ev.Network]
			for _, v := range ev.VNIs {
				hit = hit || vnis[v]
			}
			if !hit {
				continue
			}
			if !nets[ev.Network] {
				nets[ev.Network], changed = true, true
			}
			for _, v := range ev.VNIs {
				if !vnis[v] {
					vnis[v], changed = true, true
				}
			}
		}
	}
	var out []tev
	for _, ev := range evs {
		if nets[ev.Network] {
			out = append(out, ev)
		}
	}
	return out
}
