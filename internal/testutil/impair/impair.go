// Package impair is an impairment relay for tests: it stands in front of
// one gossip endpoint (UDP and TCP on one port) and forwards what reaches
// it to the real endpoint, dropping a share of the UDP datagrams and
// delaying everything by a fixed one-way delay.
//
// Why a relay: the kernel of the test machines has no netem (no tc
// qdisc to delay), and nftables can drop at random (numgen) but cannot
// delay. A relay in user space does both with real sockets: the node's
// memberlist sends real datagrams and streams through the kernel; the
// node advertises the relay's address, so every packet and stream towards
// it crosses its relay once, and a round trip crosses two relays (one
// each way).
//
// A stream (push/pull, memberlist's fallback TCP probe, large messages)
// crosses one relay, which plays both directions of the link: the
// handshake costs a round trip before the first byte goes on (a lost SYN
// or SYN-ACK one more second, Linux's initial retransmission timeout),
// every chunk is delayed by the one-way delay, and a lost chunk by a
// retransmission timeout more (200 ms plus a round trip), as TCP makes a
// lost segment late, never missing. Without this a fallback TCP probe
// would answer in one round trip and hide what the UDP loss does.
package impair

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Relay forwards UDP and TCP from its front address to a target.
type Relay struct {
	loss  float64
	delay time.Duration

	udp    *net.UDPConn
	tcp    net.Listener
	target atomic.Pointer[net.UDPAddr] // nil: drop everything until set
	tcpTo  atomic.Pointer[string]

	// Counters of UDP datagrams: forwarded and dropped on purpose.
	Forwarded, Dropped atomic.Uint64

	done  chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// New listens on host (UDP and TCP, one free port) and relays to the
// target set with SetTarget, dropping the share loss (0..1) of the UDP
// datagrams and delaying every datagram and stream chunk by delay.
func New(host string, loss float64, delay time.Duration) (*Relay, error) {
	if loss < 0 || loss >= 1 {
		return nil, fmt.Errorf("impair: loss %v must be in [0, 1)", loss)
	}
	r := &Relay{loss: loss, delay: delay, done: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	var err error
	for range 20 { // the TCP port's UDP twin may be taken: try another
		if r.tcp, err = net.Listen("tcp", net.JoinHostPort(host, "0")); err != nil {
			return nil, fmt.Errorf("impair: listen on %s: %w", host, err)
		}
		port := r.tcp.Addr().(*net.TCPAddr).Port
		if r.udp, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.ParseIP(host), Port: port}); err == nil {
			break
		}
		r.tcp.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("impair: no free UDP+TCP port on %s: %w", host, err)
	}
	r.wg.Add(2)
	go r.udpLoop()
	go r.acceptLoop()
	return r, nil
}

// Port is the relay's front port (UDP and TCP).
func (r *Relay) Port() int { return r.tcp.Addr().(*net.TCPAddr).Port }

// SetTarget sets the real endpoint ("ip:port", UDP and TCP).
func (r *Relay) SetTarget(addr string) error {
	ua, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return fmt.Errorf("impair: target %q: %w", addr, err)
	}
	r.target.Store(ua)
	r.tcpTo.Store(&addr)
	return nil
}

func (r *Relay) udpLoop() {
	defer r.wg.Done()
	buf := make([]byte, 65536)
	for {
		n, _, err := r.udp.ReadFromUDP(buf)
		if err != nil {
			return // closed
		}
		to := r.target.Load()
		if to == nil || r.lost() {
			r.Dropped.Add(1)
			continue
		}
		r.Forwarded.Add(1)
		b := append([]byte(nil), buf[:n]...)
		// Sent from the front socket: memberlist answers probes at the
		// address the probe names (the prober's relay), not at the
		// datagram's source.
		time.AfterFunc(r.delay, func() { _, _ = r.udp.WriteToUDP(b, to) })
	}
}

func (r *Relay) acceptLoop() {
	defer r.wg.Done()
	for {
		in, err := r.tcp.Accept()
		if err != nil {
			return
		}
		r.wg.Add(1)
		go r.relayStream(in)
	}
}

// relayStream plays the handshake (a round trip, a second more per lost
// SYN or SYN-ACK), then pipes both ways.
func (r *Relay) relayStream(in net.Conn) {
	defer r.wg.Done()
	to := r.tcpTo.Load()
	if to == nil {
		in.Close()
		return
	}
	handshake := 2 * r.delay
	for range 2 { // SYN, SYN-ACK
		if r.lost() {
			handshake += time.Second
		}
	}
	t := time.NewTimer(handshake) // the emulated link, not synchronisation
	select {
	case <-t.C:
	case <-r.done:
		t.Stop()
		in.Close()
		return
	}
	out, err := net.DialTimeout("tcp", *to, 5*time.Second)
	if err != nil {
		in.Close()
		return
	}
	if !r.track(in, out) {
		return
	}
	r.wg.Add(2)
	go r.pipe(out, in)
	go r.pipe(in, out)
}

func (r *Relay) lost() bool { return rand.Float64() < r.loss }

// track registers the connections for Close; false if closing.
func (r *Relay) track(cs ...net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-r.done:
		for _, c := range cs {
			c.Close()
		}
		return false
	default:
	}
	for _, c := range cs {
		r.conns[c] = struct{}{}
	}
	return true
}

type chunk struct {
	b   []byte
	due time.Time
}

// pipe copies src to dst, each chunk delay after it was read (a lost one
// a retransmission timeout later), in order.
func (r *Relay) pipe(dst, src net.Conn) {
	defer r.wg.Done()
	q := make(chan chunk, 1024)
	rto := 200*time.Millisecond + 2*r.delay
	go func() {
		defer close(q)
		buf := make([]byte, 32<<10)
		var last time.Time
		for {
			n, err := src.Read(buf)
			if n > 0 {
				due := time.Now().Add(r.delay)
				if r.lost() {
					due = due.Add(rto)
				}
				if due.Before(last) {
					due = last // in order: TCP holds back what follows a lost segment
				}
				last = due
				q <- chunk{append([]byte(nil), buf[:n]...), due}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range q {
		t := time.NewTimer(time.Until(c.due)) // the emulated link delay, not synchronisation
		select {
		case <-t.C:
		case <-r.done:
			t.Stop()
			dst.Close()
			return
		}
		if _, err := dst.Write(c.b); err != nil {
			break
		}
	}
	// Half-close so that the other side sees the end of this direction.
	if tc, ok := dst.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	} else {
		dst.Close()
	}
	for range q { // drain until src fails
	}
}

// Close stops the relay and every relayed stream.
func (r *Relay) Close() error {
	r.mu.Lock()
	select {
	case <-r.done:
		r.mu.Unlock()
		return nil
	default:
	}
	close(r.done)
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	err := errors.Join(r.udp.Close(), r.tcp.Close())
	r.wg.Wait()
	return err
}
