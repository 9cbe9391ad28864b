package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/cluster"
)

// keyStatePrefix marks the application state as overlayd's key epochs, so a
// future format can be told apart.
const keyStatePrefix = "keys1:"

func encodeKeys(k encryption.NodeKeys) []byte {
	raw, _ := json.Marshal(struct {
		A []uint32 `json:"a"`
		S uint32   `json:"s"`
		T uint32   `json:"t"`
	}{k.Accept, k.Send, k.Target})
	return append([]byte(keyStatePrefix), raw...)
}

func decodeKeys(b []byte) (encryption.NodeKeys, error) {
	if !strings.HasPrefix(string(b), keyStatePrefix) {
		return encryption.NodeKeys{}, fmt.Errorf("no key state (%d bytes)", len(b))
	}
	var v struct {
		A []uint32 `json:"a"`
		S uint32   `json:"s"`
		T uint32   `json:"t"`
	}
	if err := json.Unmarshal(b[len(keyStatePrefix):], &v); err != nil {
		return encryption.NodeKeys{}, err
	}
	return encryption.NodeKeys{Accept: v.A, Send: v.S, Target: v.T}, nil
}

// keyManager runs the cluster-wide key rotation (encryption.Step) on this
// host: it reads the key epochs every alive member advertises, computes
// this host's next state, has the driver install it, and only then
// advertises it. Rotation is therefore hitless: no host sends with an epoch
// some alive host does not accept, and an epoch is retired only once every
// host sends with a newer one.
type keyManager struct {
	d        *driver.Driver
	c        *cluster.Cluster
	self     string
	log      *slog.Logger
	interval time.Duration // periodic rotation; 0: never
	wake     chan struct{}
	stop     chan struct{}
	done     sync.WaitGroup

	mu         sync.Mutex // guards the fields below; a leaf lock
	advertised encryption.NodeKeys
	published  bool // advertised has been gossiped by this process
	rotate     bool // a rotation was requested and not yet started
	lastErr    error
}

func newKeyManager(d *driver.Driver, c *cluster.Cluster, self string, interval time.Duration, log *slog.Logger) *keyManager {
	return &keyManager{d: d, c: c, self: self, log: log, interval: interval, wake: make(chan struct{}, 1), stop: make(chan struct{})}
}

// poke asks for a step soon; it never blocks (memberlist callbacks call it).
func (km *keyManager) poke() {
	select {
	case km.wake <- struct{}{}:
	default:
	}
}

func (km *keyManager) start() {
	km.done.Add(1)
	go km.loop()
}

func (km *keyManager) close() {
	close(km.stop)
	km.done.Wait()
}

// Rotate starts a cluster-wide rotation and returns the epoch asked for.
func (km *keyManager) Rotate() (any, error) {
	km.mu.Lock()
	if km.advertised.Send == 0 {
		km.mu.Unlock()
		return nil, errors.New("keys are not established yet; retry in a moment")
	}
	km.rotate = true
	target := encryption.StartRotation(km.advertised).Target
	km.mu.Unlock()
	km.poke()
	return map[string]any{"target_epoch": target, "note": "every host accepts the new epoch, then sends with it, then retires the old one"}, nil
}

func (km *keyManager) loop() {
	defer km.done.Done()
	// A restarted host starts from what its kernel holds (persisted).
	km.mu.Lock()
	km.advertised = km.d.Keys()
	km.mu.Unlock()
	tick := time.NewTicker(time.Second) // level-triggered safety net
	defer tick.Stop()
	var rotateAt <-chan time.Time
	if km.interval > 0 {
		t := time.NewTicker(km.interval)
		defer t.Stop()
		rotateAt = t.C
	}
	for {
		km.step()
		select {
		case <-km.stop:
			return
		case <-km.wake:
		case <-tick.C:
		case <-rotateAt:
			km.mu.Lock()
			km.rotate = true
			km.mu.Unlock()
			km.log.Info("periodic key rotation")
		}
	}
}

// step computes and installs this host's next key state.
func (km *keyManager) step() {
	var others []encryption.NodeKeys
	for name, raw := range km.c.AppStates() {
		if name == km.self {
			continue
		}
		k, err := decodeKeys(raw)
		if err != nil {
			continue // a member that has not advertised keys yet
		}
		others = append(others, k)
	}
	km.mu.Lock()
	self := km.advertised
	if km.rotate && self.Send != 0 {
		self = encryption.StartRotation(self)
		km.rotate = false
	}
	km.mu.Unlock()
	next := encryption.Step(self, others)
	km.mu.Lock()
	same := next.Equal(km.advertised) && km.published
	km.mu.Unlock()
	if same {
		return
	}
	if err := km.d.SetKeys(next); err != nil {
		km.mu.Lock()
		first := km.lastErr == nil || km.lastErr.Error() != err.Error()
		km.lastErr = err
		km.mu.Unlock()
		if first {
			km.log.Error("cannot install the next key epochs; keeping the current ones", "next", next.String(), "error", err)
		}
		return
	}
	if err := km.c.SetAppState(encodeKeys(next)); err != nil {
		km.log.Warn("advertising key epochs", "error", err)
		return
	}
	km.mu.Lock()
	prev := km.advertised
	km.advertised, km.lastErr, km.published = next, nil, true
	km.mu.Unlock()
	if !prev.Equal(next) {
		km.log.Info("key epochs", "accept", next.Accept, "send", next.Send, "target", next.Target)
	}
}

// memberKeys returns the key epochs every alive member advertises, for
// status.
func (km *keyManager) memberKeys() map[string]string {
	out := map[string]string{}
	names := []string{}
	states := km.c.AppStates()
	for n := range states {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if k, err := decodeKeys(states[n]); err == nil {
			out[n] = k.String()
		} else {
			out[n] = "none"
		}
	}
	return out
}
