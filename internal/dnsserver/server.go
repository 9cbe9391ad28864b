// Package dnsserver is the DNS server containers on overlayd networks ask:
// it answers the cluster's names (through Names) and forwards every other
// query to the host's resolvers.
//
// The server answers anyone whose packets reach it: it is not an open
// resolver only because the caller binds its sockets inside
// container-facing network namespaces, never on the underlay.
//
// Response codes, decided here and relied on by tests:
//   - a cluster name: NOERROR with its addresses of the asked family, in the
//     order Lookup returns them (stable: callers that want load spreading
//     rotate there; clients see the same order as from one host's dockerd),
//     or NOERROR without answers (NODATA) for any other type; a cluster
//     name is never forwarded;
//   - class other than IN: REFUSED (the name space of other classes is not
//     ours to answer, and REFUSED makes a stub try its next server);
//   - opcode other than QUERY: NOTIMP;
//   - more than one question, none, a request that does not parse, or a UDP
//     request over MaxUDPRequest bytes: FORMERR when a 12-byte header can be
//     read, else the packet is dropped; packets with the QR bit set are
//     dropped (never answer an answer: no loops between two servers);
//   - forwarded names: the upstream's answer with the client's ID; SERVFAIL
//     when no upstream is configured, none answered within Timeout, or more
//     than MaxForwards forwards are in flight (SERVFAIL, not REFUSED: the
//     condition is temporary, and REFUSED would read as a policy).
package dnsserver

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
)

// Names answers cluster names. Implementations are safe for concurrent
// use and never block (no network, no locks held long).
type Names interface {
	// Lookup returns the addresses of name as seen by a client at addr
	// that queried the server of network (an overlayd network ID). name is
	// lower case, without the trailing dot. found is false when name is
	// not a cluster name visible to that client: the query is then
	// forwarded.
	Lookup(network string, client netip.Addr, name string) (addrs []netip.Addr, found bool)
}

// HostListener is the network name of a listener that serves no network
// (the host's): it answers no cluster name, it forwards.
const HostListener = "host"

// Defaults of Config.
const (
	DefaultTimeout     = 2 * time.Second
	DefaultMaxForwards = 256
	// MaxUDPRequest is the largest UDP request answered: a query is a few
	// hundred bytes at most (a question and an OPT record); anything
	// longer is junk or an attack and gets FORMERR.
	MaxUDPRequest = 4096
	// maxTCPConns bounds the TCP connections served at once per Serve.
	maxTCPConns = 64
	// tcpIdle is how long a TCP connection may stay without a request.
	tcpIdle = 10 * time.Second
	// advertisedUDPSize is the EDNS0 size this server announces: the
	// DNS flag day's 1232, which fits any path's MTU.
	advertisedUDPSize = 1232
	// headerSize is the DNS header's length.
	headerSize = 12
)

// Config configures a Server.
type Config struct {
	// Names answers cluster names. Required.
	Names Names
	// Upstreams are the resolvers to forward to (the host's
	// resolv.conf), read per query so that changes apply at once. Empty
	// (or nil): forwarded names get SERVFAIL.
	Upstreams func() []netip.AddrPort
	// Timeout bounds each attempt of a forwarded query (per upstream and
	// per transport). Zero: DefaultTimeout.
	Timeout time.Duration
	// MaxForwards bounds the forwarded queries in flight across all
	// Serve calls; a query beyond it gets SERVFAIL at once. Zero:
	// DefaultMaxForwards.
	MaxForwards int
	// TTL of cluster answers, in seconds. The default (zero) lets no
	// client or intermediate cache keep a name: a removed container must
	// stop resolving within 2 s, and dockerd's embedded resolver, which
	// may sit between a container and this server, caches nothing either,
	// so zero costs only the (cheap) lookups.
	TTL uint32
	// Logger receives the server's log lines. Nil: slog.Default().
	Logger *slog.Logger
}

// Server answers DNS queries for one or more networks.
type Server struct {
	names     Names
	upstreams func() []netip.AddrPort
	timeout   time.Duration
	ttl       uint32
	log       *slog.Logger
	// fwd holds one token per forward in flight.
	fwd chan struct{}
	m   *collector
}

// New checks cfg and makes a Server.
func New(cfg Config) (*Server, error) {
	if cfg.Names == nil {
		return nil, errors.New("dnsserver: Config.Names is nil")
	}
	if cfg.Timeout < 0 || cfg.MaxForwards < 0 {
		return nil, fmt.Errorf("dnsserver: negative Timeout (%v) or MaxForwards (%d)", cfg.Timeout, cfg.MaxForwards)
	}
	s := &Server{
		names:     cfg.Names,
		upstreams: cfg.Upstreams,
		timeout:   cfg.Timeout,
		ttl:       cfg.TTL,
		log:       cfg.Logger,
		m:         newCollector(),
	}
	if s.upstreams == nil {
		s.upstreams = func() []netip.AddrPort { return nil }
	}
	if s.timeout == 0 {
		s.timeout = DefaultTimeout
	}
	if cfg.MaxForwards == 0 {
		cfg.MaxForwards = DefaultMaxForwards
	}
	s.fwd = make(chan struct{}, cfg.MaxForwards)
	if s.log == nil {
		s.log = slog.Default()
	}
	return s, nil
}

// Collector is the server's metrics, to register with the daemon's
// registry.
func (s *Server) Collector() prometheus.Collector { return s.m }

// Serve answers queries arriving on pc (UDP) and ln (TCP, may be nil) for
// network until ctx ends or they are closed; it closes both when it
// returns. Forwarding uses sockets the Server opens itself, from goroutines
// Serve starts: the caller must call Serve from a goroutine whose thread is
// in the host's network namespace (not one locked to a switched thread),
// so that they inherit it. It returns nil when ctx ended, else the error
// that stopped a listener.
func (s *Server) Serve(ctx context.Context, network string, pc net.PacketConn, ln net.Listener) error {
	if pc == nil {
		return errors.New("dnsserver: Serve without a packet conn")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Add(1)
	go func() {
		defer wg.Done()
		errs <- s.serveUDP(ctx, network, pc)
		cancel()
	}()
	if ln != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- s.serveTCP(ctx, network, ln)
			cancel()
		}()
	}
	<-ctx.Done()
	pc.Close()
	if ln != nil {
		ln.Close()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil && !errors.Is(err, net.ErrClosed) {
			return err
		}
	}
	return nil
}

func (s *Server) serveUDP(ctx context.Context, network string, pc net.PacketConn) error {
	var inflight sync.WaitGroup
	defer inflight.Wait()
	buf := make([]byte, 65536)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("dnsserver: read UDP for network %s: %w", network, err)
		}
		client := addrOf(from)
		resp, fwd := s.answer(network, client, buf[:n], true)
		if fwd == nil {
			if resp != nil {
				pc.WriteTo(resp, from)
			}
			continue
		}
		if !s.acquire() {
			pc.WriteTo(s.overloaded(fwd), from)
			continue
		}
		inflight.Add(1)
		go func() {
			defer inflight.Done()
			defer s.release()
			pc.WriteTo(s.forward(ctx, fwd), from)
		}()
	}
}

func (s *Server) serveTCP(ctx context.Context, network string, ln net.Listener) error {
	var conns sync.WaitGroup
	defer conns.Wait()
	slots := make(chan struct{}, maxTCPConns)
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("dnsserver: accept TCP for network %s: %w", network, err)
		}
		select {
		case slots <- struct{}{}:
		default:
			// Full: refuse the connection rather than queue it, so that
			// idle connections cannot pin the server.
			c.Close()
			continue
		}
		conns.Add(1)
		go func() {
			defer conns.Done()
			defer func() { <-slots }()
			s.serveConn(ctx, network, c)
		}()
	}
}

// serveConn answers the queries of one TCP connection in order, one at a
// time (enough for stubs, which send one or two).
func (s *Server) serveConn(ctx context.Context, network string, c net.Conn) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	client := addrOf(c.RemoteAddr())
	var lenBuf [2]byte
	buf := make([]byte, 65535)
	for {
		c.SetReadDeadline(time.Now().Add(tcpIdle))
		if _, err := io.ReadFull(c, lenBuf[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint16(lenBuf[:]))
		if _, err := io.ReadFull(c, buf[:n]); err != nil {
			return
		}
		resp, fwd := s.answer(network, client, buf[:n], false)
		if fwd != nil {
			if !s.acquire() {
				resp = s.overloaded(fwd)
			} else {
				resp = s.forward(ctx, fwd)
				s.release()
			}
		}
		if resp == nil {
			return // undecodable: the stream may be out of step
		}
		c.SetWriteDeadline(time.Now().Add(s.timeout))
		out := make([]byte, 2+len(resp))
		binary.BigEndian.PutUint16(out, uint16(len(resp)))
		copy(out[2:], resp)
		if _, err := c.Write(out); err != nil {
			return
		}
	}
}

func (s *Server) acquire() bool {
	select {
	case s.fwd <- struct{}{}:
		return true
	default:
		return false
	}
}

func (s *Server) release() { <-s.fwd }

func addrOf(a net.Addr) netip.Addr {
	switch a := a.(type) {
	case *net.UDPAddr:
		return a.AddrPort().Addr().Unmap()
	case *net.TCPAddr:
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// forwardReq is a query to forward: the client's request and the size its
// answer must fit (0: TCP, no limit).
type forwardReq struct {
	req  *dns.Msg
	size int
	udp  bool
}

// Handle answers one request as Serve does, forwarding if needed (under
// ctx): the response's bytes, or nil when the request is dropped. udp says
// whether the response must fit the client's UDP size. It is the whole
// packet handler without sockets (for the fuzz target and for callers
// with their own transport).
func (s *Server) Handle(ctx context.Context, network string, client netip.Addr, req []byte, udp bool) []byte {
	resp, fwd := s.answer(network, client, req, udp)
	if fwd == nil {
		return resp
	}
	if !s.acquire() {
		return s.overloaded(fwd)
	}
	defer s.release()
	return s.forward(ctx, fwd)
}

// answer answers req unless it must be forwarded: then it returns fwd and
// does no network I/O, so that the caller decides where to wait for it.
func (s *Server) answer(network string, client netip.Addr, req []byte, udp bool) (resp []byte, fwd *forwardReq) {
	if len(req) < headerSize {
		s.m.dropped.Inc()
		return nil, nil
	}
	if req[2]&0x80 != 0 { // QR: an answer, not a query
		s.m.dropped.Inc()
		return nil, nil
	}
	if network == HostListener {
		s.m.queries.WithLabelValues("host").Inc()
	} else {
		s.m.queries.WithLabelValues("network").Inc()
	}
	if udp && len(req) > MaxUDPRequest {
		return s.headerError(req, dns.RcodeFormatError), nil
	}
	q := new(dns.Msg)
	if err := q.Unpack(req); err != nil {
		return s.headerError(req, dns.RcodeFormatError), nil
	}
	if q.Opcode != dns.OpcodeQuery {
		return s.errorReply(q, dns.RcodeNotImplemented), nil
	}
	if len(q.Question) != 1 {
		return s.errorReply(q, dns.RcodeFormatError), nil
	}
	question := q.Question[0]
	if question.Qclass != dns.ClassINET {
		return s.errorReply(q, dns.RcodeRefused), nil
	}
	size := 0
	if udp {
		size = dns.MinMsgSize
		if opt := q.IsEdns0(); opt != nil && int(opt.UDPSize()) > size {
			size = int(opt.UDPSize())
		}
	}
	name := strings.ToLower(strings.TrimSuffix(question.Name, "."))
	addrs, found := s.names.Lookup(network, client, name)
	if !found {
		return nil, &forwardReq{req: q, size: size, udp: udp}
	}
	r := s.reply(q, dns.RcodeSuccess)
	r.Authoritative = true
	for _, a := range addrs {
		a = a.Unmap()
		hdr := dns.RR_Header{Name: question.Name, Class: dns.ClassINET, Ttl: s.ttl}
		switch {
		case question.Qtype == dns.TypeA && a.Is4():
			hdr.Rrtype = dns.TypeA
			b := a.As4()
			r.Answer = append(r.Answer, &dns.A{Hdr: hdr, A: net.IP(b[:])})
		case question.Qtype == dns.TypeAAAA && a.Is6():
			hdr.Rrtype = dns.TypeAAAA
			b := a.As16()
			r.Answer = append(r.Answer, &dns.AAAA{Hdr: hdr, AAAA: net.IP(b[:])})
		}
	}
	if len(r.Answer) > 0 {
		s.m.results.WithLabelValues(resultAnswer).Inc()
	} else {
		s.m.results.WithLabelValues(resultNoData).Inc()
	}
	return s.pack(r, size), nil
}

// reply starts the response to q: its ID, opcode, question, RD, and an
// OPT record when q had one (EDNS0 answers EDNS0).
func (s *Server) reply(q *dns.Msg, rcode int) *dns.Msg {
	r := new(dns.Msg)
	r.Id = q.Id
	r.Response = true
	r.Opcode = q.Opcode
	r.RecursionDesired = q.RecursionDesired
	r.RecursionAvailable = true
	r.Rcode = rcode
	if q.Opcode == dns.OpcodeQuery && len(q.Question) == 1 {
		r.Question = q.Question
	}
	if q.IsEdns0() != nil {
		r.SetEdns0(advertisedUDPSize, false)
	}
	return r
}

func (s *Server) errorReply(q *dns.Msg, rcode int) []byte {
	s.m.countRcode(rcode)
	return s.pack(s.reply(q, rcode), 0)
}

// headerError answers a request whose body does not parse: its header's
// ID and opcode, no sections.
func (s *Server) headerError(req []byte, rcode int) []byte {
	s.m.countRcode(rcode)
	out := make([]byte, headerSize)
	copy(out[:2], req[:2])
	out[2] = 0x80 | req[2]&0x79 // QR, the opcode, RD
	out[3] = 0x80 | byte(rcode) // RA
	return out
}

// overloaded answers a query that would be forwarded when MaxForwards are
// in flight.
func (s *Server) overloaded(f *forwardReq) []byte {
	s.m.forwards.WithLabelValues(forwardOverload).Inc()
	s.m.countRcode(dns.RcodeServerFailure)
	return s.pack(s.reply(f.req, dns.RcodeServerFailure), f.size)
}

// pack encodes r to fit size bytes (0: any), truncating (with TC) when it
// does not fit. A message that does not encode (never expected: every
// name came from a parsed request) is answered with SERVFAIL.
func (s *Server) pack(r *dns.Msg, size int) []byte {
	if size > 0 {
		r.Truncate(size)
	}
	b, err := r.Pack()
	if err != nil {
		s.log.Warn("dnsserver: cannot encode a response", "error", err.Error())
		e := new(dns.Msg)
		e.Id = r.Id
		e.Response = true
		e.Rcode = dns.RcodeServerFailure
		b, _ = e.Pack()
	}
	return b
}

// forward asks the upstreams in order (UDP, then TCP when the answer is
// truncated) and returns the first answer, with the client's ID and cut
// to the client's size; SERVFAIL when none answers.
func (s *Server) forward(ctx context.Context, f *forwardReq) []byte {
	start := time.Now()
	ups := s.upstreams()
	q := f.req.Copy()
	// Ask upstreams with a size of our own (they may answer up to it over
	// UDP; cut to the client's below).
	if opt := q.IsEdns0(); opt != nil {
		opt.SetUDPSize(advertisedUDPSize)
	} else {
		q.SetEdns0(advertisedUDPSize, false)
	}
	clientEDNS := f.req.IsEdns0() != nil
	for _, up := range ups {
		if ctx.Err() != nil {
			break
		}
		r, err := s.exchange(ctx, "udp", up, q)
		if err == nil && r.Truncated {
			r, err = s.exchange(ctx, "tcp", up, q)
		}
		if err != nil {
			s.log.Debug("dnsserver: upstream did not answer", "upstream", up.String(), "error", err.Error())
			continue
		}
		s.m.latency.Observe(time.Since(start).Seconds())
		if r.Rcode == dns.RcodeNameError {
			s.m.forwards.WithLabelValues(forwardNXDomain).Inc()
		} else {
			s.m.forwards.WithLabelValues(forwardOK).Inc()
		}
		r.Id = f.req.Id
		if !clientEDNS {
			// A client without EDNS0 must not receive an OPT record.
			for i := 0; i < len(r.Extra); i++ {
				if r.Extra[i].Header().Rrtype == dns.TypeOPT {
					r.Extra = append(r.Extra[:i], r.Extra[i+1:]...)
					i--
				}
			}
		}
		return s.pack(r, f.size)
	}
	s.m.latency.Observe(time.Since(start).Seconds())
	s.m.forwards.WithLabelValues(forwardFailed).Inc()
	s.m.countRcode(dns.RcodeServerFailure)
	return s.pack(s.reply(f.req, dns.RcodeServerFailure), f.size)
}

func (s *Server) exchange(ctx context.Context, network string, up netip.AddrPort, q *dns.Msg) (*dns.Msg, error) {
	c := &dns.Client{Net: network, Timeout: s.timeout, UDPSize: advertisedUDPSize}
	m := q.Copy()
	// An ID of our own: a forged answer must guess it, and the client's
	// ID (perhaps predictable) stays between it and us.
	m.Id = dns.Id()
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	r, _, err := c.ExchangeContext(ctx, m, up.String())
	if err != nil {
		return nil, err
	}
	return r, nil
}
