package encryption

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func nk(accept []uint32, send, target uint32) NodeKeys {
	return NodeKeys{Accept: accept, Send: send, Target: target}
}

func TestStepTable(t *testing.T) {
	steady := func(e uint32) NodeKeys { return nk([]uint32{e}, e, e) }
	for _, c := range []struct {
		name   string
		self   NodeKeys
		others []NodeKeys
		want   NodeKeys
	}{
		{"lone first host bootstraps epoch 1", NodeKeys{}, nil, steady(1)},
		{"steady state is a fixed point", steady(5), []NodeKeys{steady(5), steady(5)}, steady(5)},
		{"rotation asked here: accept the target, keep sending", nk([]uint32{5}, 5, 6), []NodeKeys{steady(5)}, nk([]uint32{5, 6}, 5, 6)},
		{"rotation seen from a peer: accept its target", steady(5), []NodeKeys{nk([]uint32{5}, 5, 6)}, nk([]uint32{5, 6}, 5, 6)},
		{"do not send before everyone accepts", nk([]uint32{5, 6}, 5, 6), []NodeKeys{nk([]uint32{5, 6}, 5, 6), steady(5)}, nk([]uint32{5, 6}, 5, 6)},
		{"switch when everyone accepts", nk([]uint32{5, 6}, 5, 6), []NodeKeys{nk([]uint32{5, 6}, 5, 6), nk([]uint32{5, 6}, 5, 6)}, nk([]uint32{5, 6}, 6, 6)},
		{"accept and switch in one step when the others already accept", steady(5), []NodeKeys{nk([]uint32{5, 6}, 5, 6)}, nk([]uint32{5, 6}, 6, 6)},
		{"do not retire while someone sends the old epoch", nk([]uint32{5, 6}, 6, 6), []NodeKeys{nk([]uint32{5, 6}, 5, 6)}, nk([]uint32{5, 6}, 6, 6)},
		{"retire once everyone sends newer", nk([]uint32{5, 6}, 6, 6), []NodeKeys{nk([]uint32{5, 6}, 6, 6), nk([]uint32{6}, 6, 6)}, steady(6)},
		{"overlapping rotation: target jumps again before the switch",
			nk([]uint32{5, 6}, 5, 6), []NodeKeys{nk([]uint32{5, 6, 7}, 5, 7)}, nk([]uint32{5, 6, 7}, 7, 7)},
		{"overlapping rotation: newer target while others still accept only the first",
			nk([]uint32{5, 6}, 5, 7), []NodeKeys{nk([]uint32{5, 6}, 5, 6)}, nk([]uint32{5, 6, 7}, 6, 7)},
		{"overlapping rotation: skipped epoch retired with the old one",
			nk([]uint32{5, 6, 7}, 7, 7), []NodeKeys{nk([]uint32{6, 7}, 7, 7)}, steady(7)},
		{"a switched epoch is kept while someone still sends the skipped one",
			nk([]uint32{5, 6, 7}, 7, 7), []NodeKeys{nk([]uint32{5, 6, 7}, 6, 7)}, nk([]uint32{6, 7}, 7, 7)},
		{"send never goes backwards", nk([]uint32{6, 7}, 7, 7), []NodeKeys{nk([]uint32{6}, 6, 6)}, nk([]uint32{6, 7}, 7, 7)},
		{"restart with an old state: accept what is sent now, switch, retire",
			steady(3), []NodeKeys{steady(5), steady(5)}, steady(5)},
		{"peers of a restarted host accept its old epoch until it moves",
			steady(5), []NodeKeys{steady(5), steady(3)}, nk([]uint32{3, 5}, 5, 5)},
		{"host that missed a whole rotation (was steady 5, cluster at 6 mid-retirement)",
			steady(5), []NodeKeys{nk([]uint32{5, 6}, 6, 6), nk([]uint32{6}, 6, 6)}, steady(6)},
		{"host that missed a whole rotation while someone still sends 5",
			steady(5), []NodeKeys{nk([]uint32{5, 6}, 5, 6), nk([]uint32{5, 6}, 6, 6)}, nk([]uint32{5, 6}, 6, 6)},
		{"join mid-rotation: accept what is sent and the target, send what all accept",
			NodeKeys{}, []NodeKeys{nk([]uint32{5, 6}, 5, 6), nk([]uint32{5, 6}, 6, 6)}, nk([]uint32{5, 6}, 6, 6)},
		{"join mid-rotation before anyone accepts the target",
			NodeKeys{}, []NodeKeys{nk([]uint32{5, 6}, 5, 6), steady(5)}, nk([]uint32{5, 6}, 5, 6)},
		{"a joiner that does not send yet blocks retirement",
			nk([]uint32{5, 6}, 6, 6), []NodeKeys{nk([]uint32{5, 6}, 6, 6), {}}, nk([]uint32{5, 6}, 6, 6)},
		{"a dead member is not passed and does not count",
			nk([]uint32{5, 6}, 5, 6), []NodeKeys{nk([]uint32{5, 6}, 5, 6)}, nk([]uint32{5, 6}, 6, 6)},
		{"garbage accept set is normalised", nk([]uint32{6, 0, 5, 6}, 6, 6), []NodeKeys{steady(6)}, steady(6)},
		{"send is always accepted", nk(nil, 4, 4), nil, steady(4)},
	} {
		t.Run(c.name, func(t *testing.T) {
			self := c.self.Clone()
			got := Step(c.self, c.others)
			if !got.Equal(c.want) {
				t.Fatalf("Step(%v, %v) = %v, want %v", c.self, c.others, got, c.want)
			}
			if !self.Equal(c.self) || !slices.Equal(self.Accept, c.self.Accept) {
				t.Fatalf("Step modified its input")
			}
			// Level-triggered: stepping again with the same view changes
			// nothing more than one more step of the rules would.
			if again := Step(got, c.others); !again.Equal(Step(again, c.others)) {
				t.Fatalf("not converging: %v -> %v -> %v", got, again, Step(again, c.others))
			}
		})
	}
}

func TestStartRotation(t *testing.T) {
	if got := StartRotation(nk([]uint32{5, 6}, 5, 6)); got.Target != 7 {
		t.Fatalf("target %d, want 7", got.Target)
	}
	if got := StartRotation(NodeKeys{}); got.Target != 1 {
		t.Fatalf("target %d, want 1", got.Target)
	}
	last := nk([]uint32{math.MaxUint32}, math.MaxUint32, math.MaxUint32)
	if got := StartRotation(last); got.Target != math.MaxUint32 {
		t.Fatalf("overflowed: %v", got)
	}
}

// TestRotationSimulation drives clusters through random schedules: hosts
// step in random order with stale views of each other (each host sees what
// another advertised at some earlier time, never going back), rotations
// are asked at random (also while one is running), hosts die, restart from
// old state or join. After every step it checks the hitless invariant
// against what the alive hosts' kernels hold: no alive host sends with an
// epoch that another alive host does not accept. Every schedule must
// converge to one epoch everywhere once rotations stop.
func TestRotationSimulation(t *testing.T) {
	seeds := 300
	if testing.Short() {
		seeds = 50
	}
	for seed := 0; seed < seeds; seed++ {
		simulate(t, uint64(seed))
		if t.Failed() {
			return
		}
	}
}

func simulate(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 42))
	n := 2 + rng.IntN(5)
	type node struct {
		alive   bool
		state   NodeKeys   // advertised (= what its kernel holds)
		history []NodeKeys // every state it advertised
		seen    []int      // per other node: index into its history last seen
	}
	nodes := make([]*node, n)
	for i := range nodes {
		nodes[i] = &node{alive: true, state: nk([]uint32{1}, 1, 1), seen: make([]int, n)}
		nodes[i].history = []NodeKeys{nodes[i].state}
	}
	view := func(i int) []NodeKeys {
		var out []NodeKeys
		for j, o := range nodes {
			if j == i || !o.alive {
				continue
			}
			// Advance the view of j by a random amount (gossip delay).
			me := nodes[i]
			if me.seen[j] >= len(o.history) {
				me.seen[j] = len(o.history) - 1
			}
			me.seen[j] += rng.IntN(len(o.history) - me.seen[j])
			if rng.IntN(3) == 0 {
				me.seen[j] = len(o.history) - 1
			}
			out = append(out, o.history[me.seen[j]])
		}
		return out
	}
	check := func(when string) {
		for i, a := range nodes {
			for j, b := range nodes {
				if i == j || !a.alive || !b.alive || a.state.Send == 0 {
					continue
				}
				if !b.state.Accepts(a.state.Send) {
					t.Fatalf("seed %d, %s: host %d sends with %d but host %d accepts only %v\nstates: %v",
						seed, when, i, a.state.Send, j, b.state.Accept, states(nodes, func(x *node) NodeKeys { return x.state }))
				}
			}
		}
	}
	advertise := func(i int, s NodeKeys) {
		nodes[i].state = s
		nodes[i].history = append(nodes[i].history, s)
	}
	steps := 200 + rng.IntN(300)
	for s := 0; s < steps; s++ {
		i := rng.IntN(n)
		nd := nodes[i]
		switch r := rng.IntN(100); {
		case r < 5:
			if nd.alive {
				advertise(i, StartRotation(nd.state))
			}
		case r < 7 && nd.alive && aliveCount(nodes, func(x *node) bool { return x.alive }) > 1:
			// Dies (never the last one: a cluster that restarts entirely
			// from old or lost state merges diverged histories, which
			// costs one step of loss, see the doc of Step). Its last advertisement is forgotten by the others
			// (memberlist removes the member); it keeps its kernel state.
			nd.alive = false
		case r < 9 && !nd.alive:
			// Comes back with the state it had, an older one, or nothing
			// (state lost). Before advertising anything or touching its
			// kernel it steps once on a fresh view of the cluster.
			nd.alive = true
			base := nd.state
			switch rng.IntN(3) {
			case 1:
				base = nd.history[rng.IntN(len(nd.history))].Clone()
			case 2:
				base = NodeKeys{}
			}
			advertise(i, Step(base, latest(nodes, i, func(x *node) (NodeKeys, bool) { return x.state, x.alive })))
		default:
			if nd.alive {
				advertise(i, Step(nd.state, view(i)))
			}
		}
		check(fmt.Sprintf("step %d", s))
	}
	// Quiesce: everyone alive, full views, until a fixed point.
	for _, nd := range nodes {
		if !nd.alive {
			nd.alive = true
		}
	}
	for round := 0; ; round++ {
		changed := false
		for i := range nodes {
			next := Step(nodes[i].state, latest(nodes, i, func(x *node) (NodeKeys, bool) { return x.state, x.alive }))
			if !next.Equal(nodes[i].state) {
				changed = true
				advertise(i, next)
			}
		}
		if !changed {
			break
		}
		if round > 20 {
			t.Fatalf("seed %d: no convergence after %d rounds: %v", seed, round, states(nodes, func(x *node) NodeKeys { return x.state }))
		}
	}
	first := nodes[0].state
	if seed < 5 {
		adverts := 0
		for _, nd := range nodes {
			adverts += len(nd.history)
		}
		t.Logf("seed %d: %d hosts converged on %v after %d steps (%d advertisements)", seed, n, first, steps, adverts)
	}
	for i, nd := range nodes {
		if len(nd.state.Accept) != 1 || nd.state.Send != first.Send || !nd.state.Equal(first) {
			t.Fatalf("seed %d: did not converge on one epoch: host %d %v vs host 0 %v", seed, i, nd.state, first)
		}
	}
}

func latest[T any](nodes []T, self int, get func(T) (NodeKeys, bool)) []NodeKeys {
	var out []NodeKeys
	for j, o := range nodes {
		if s, alive := get(o); j != self && alive {
			out = append(out, s)
		}
	}
	return out
}

func aliveCount[T any](nodes []T, alive func(T) bool) int {
	n := 0
	for _, x := range nodes {
		if alive(x) {
			n++
		}
	}
	return n
}

func states[T any](nodes []T, get func(T) NodeKeys) []string {
	var out []string
	for _, nd := range nodes {
		out = append(out, get(nd).String())
	}
	return out
}
