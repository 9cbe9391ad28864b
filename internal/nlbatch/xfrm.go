package nlbatch

import (
	"fmt"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// The xfrm family (NETLINK_XFRM): IPsec SAs and policies, queued into an
// XfrmBatch and sent by Conn.Send.
//
// netlink v1.3.1 sends every xfrm request on its own and waits for its
// acknowledgement: one round trip per SA or policy. Here they go many to a
// datagram, each with its own outcome. The messages are built from the
// netlink package's structs for the fields overlayd's encryption uses (see
// XfrmBatch.AddState, XfrmBatch.SetPolicy): the kernel's own request
// layout, not a copy of the library's code paths.

// XfrmBatch is a list of xfrm requests to send together (Conn.Send). An
// XfrmBatch can be reused after Reset.
type XfrmBatch struct {
	msgs []byte // the requests, each a whole netlink message
	ends []int  // end offset of each request in msgs
}

// Len is the number of requests queued.
func (b *XfrmBatch) Len() int { return len(b.ends) }

// Reset empties b, keeping its memory.
func (b *XfrmBatch) Reset() { b.msgs, b.ends = b.msgs[:0], b.ends[:0] }

func (b *XfrmBatch) begin(typ int, flags uint16) int {
	var start int
	b.msgs, start = beginMsg(b.msgs, uint16(typ), flags)
	return start
}

func (b *XfrmBatch) attr(typ uint16, data []byte) { b.msgs = appendAttr(b.msgs, typ, data) }

func (b *XfrmBatch) end(start int) {
	b.msgs = endMsg(b.msgs, start)
	b.ends = append(b.ends, len(b.msgs))
}

// AddState queues XFRM_MSG_NEWSA for s (create, exclusive). Used fields:
// Src, Dst, Proto, Mode, Spi, Reqid, ReplayWindow with ESN, Aead, Mark,
// Selector (Src, Dst, Proto, DstPort, SrcPort). Others must be zero.
func (b *XfrmBatch) AddState(s *netlink.XfrmState) error {
	if s.Spi == 0 || s.Auth != nil || s.Crypt != nil || s.Encap != nil || s.OutputMark != nil || s.Ifid != 0 || s.Replay != nil || s.SADir != 0 || s.Pcpunum != nil {
		return fmt.Errorf("nlbatch: SA spi 0x%08x dst %v: only AEAD transport states with a non-zero SPI can be batched", uint32(s.Spi), s.Dst)
	}
	info := nl.XfrmUsersaInfo{Family: uint16(nl.GetIPFamily(s.Dst)), Mode: uint8(s.Mode), Reqid: uint32(s.Reqid), ReplayWindow: uint8(s.ReplayWindow)}
	info.Id.Daddr.FromIP(s.Dst)
	info.Id.Proto = uint8(s.Proto)
	info.Id.Spi = nl.Swap32(uint32(s.Spi))
	info.Saddr.FromIP(s.Src)
	if s.Selector != nil {
		selector(&info.Sel, s.Selector)
	}
	info.Lft = infinite()
	if s.ESN {
		if s.ReplayWindow == 0 {
			return fmt.Errorf("nlbatch: SA spi 0x%08x dst %v: ESN without a replay window", uint32(s.Spi), s.Dst)
		}
		info.Flags |= nl.XFRM_STATE_ESN
		info.ReplayWindow = 0
	}
	start := b.begin(nl.XFRM_MSG_NEWSA, unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b.msgs = append(b.msgs, info.Serialize()...)
	if s.Aead != nil {
		name := [64]byte{}
		copy(name[:63], s.Aead.Name)
		algo := nl.XfrmAlgoAEAD{AlgName: name, AlgKeyLen: uint32(len(s.Aead.Key) * 8), AlgICVLen: uint32(s.Aead.ICVLen), AlgKey: s.Aead.Key}
		b.attr(nl.XFRMA_ALG_AEAD, algo.Serialize())
	}
	if s.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(s.Mark))
	}
	if s.ESN {
		bmp := (uint32(s.ReplayWindow) + 31) / 32
		esn := nl.XfrmReplayStateEsn{BmpLen: bmp, ReplayWindow: uint32(s.ReplayWindow)}
		b.attr(nl.XFRMA_REPLAY_ESN_VAL, esn.Serialize())
	}
	b.end(start)
	return nil
}

// DelState queues XFRM_MSG_DELSA for the SA of s's Dst, Spi, Proto, Src
// and Mark.
func (b *XfrmBatch) DelState(s *netlink.XfrmState) {
	id := nl.XfrmUsersaId{Family: uint16(nl.GetIPFamily(s.Dst)), Proto: uint8(s.Proto), Spi: nl.Swap32(uint32(s.Spi))}
	id.Daddr.FromIP(s.Dst)
	start := b.begin(nl.XFRM_MSG_DELSA, 0)
	b.msgs = append(b.msgs, id.Serialize()...)
	if s.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(s.Mark))
	}
	if s.Src != nil {
		b.attr(nl.XFRMA_SRCADDR, s.Src.To16())
	}
	b.end(start)
}

// SetPolicy queues XFRM_MSG_NEWPOLICY for pol (exclusive: an existing
// policy of that selector is an EEXIST error), or XFRM_MSG_UPDPOLICY
// (create or replace) with update. Used fields: Src, Dst, Proto, DstPort,
// SrcPort, Dir, Priority, Index, Action, Mark, Tmpls, Ifindex.
func (b *XfrmBatch) SetPolicy(pol *netlink.XfrmPolicy, update bool) error {
	if pol.Ifid != 0 {
		return fmt.Errorf("nlbatch: policy src %v dst %v: policies with an interface id cannot be batched", pol.Src, pol.Dst)
	}
	info := nl.XfrmUserpolicyInfo{Priority: uint32(pol.Priority), Index: uint32(pol.Index), Dir: uint8(pol.Dir), Action: uint8(pol.Action), Lft: infinite()}
	selector(&info.Sel, pol)
	typ := nl.XFRM_MSG_NEWPOLICY
	if update {
		typ = nl.XFRM_MSG_UPDPOLICY
	}
	start := b.begin(typ, unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b.msgs = append(b.msgs, info.Serialize()...)
	if len(pol.Tmpls) > 0 {
		tmpls := make([]byte, 0, nl.SizeofXfrmUserTmpl*len(pol.Tmpls))
		for i := range pol.Tmpls {
			t := &pol.Tmpls[i]
			u := nl.XfrmUserTmpl{Family: uint16(nl.GetIPFamily(t.Dst)), Mode: uint8(t.Mode), Reqid: uint32(t.Reqid), Optional: uint8(t.Optional),
				Aalgos: ^uint32(0), Ealgos: ^uint32(0), Calgos: ^uint32(0)}
			u.XfrmId.Daddr.FromIP(t.Dst)
			u.XfrmId.Proto = uint8(t.Proto)
			u.XfrmId.Spi = nl.Swap32(uint32(t.Spi))
			u.Saddr.FromIP(t.Src)
			tmpls = append(tmpls, u.Serialize()...)
		}
		b.attr(nl.XFRMA_TMPL, tmpls)
	}
	if pol.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(pol.Mark))
	}
	b.end(start)
	return nil
}

// DelPolicy queues XFRM_MSG_DELPOLICY for the policy of pol's selector,
// direction, index and mark (templates are not part of a policy's
// identity).
func (b *XfrmBatch) DelPolicy(pol *netlink.XfrmPolicy) {
	id := nl.XfrmUserpolicyId{Index: uint32(pol.Index), Dir: uint8(pol.Dir)}
	selector(&id.Sel, pol)
	start := b.begin(nl.XFRM_MSG_DELPOLICY, 0)
	b.msgs = append(b.msgs, id.Serialize()...)
	if pol.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(pol.Mark))
	}
	b.end(start)
}

// selector fills sel from a policy-shaped selector.
func selector(sel *nl.XfrmSelector, p *netlink.XfrmPolicy) {
	sel.Family = uint16(nl.FAMILY_V4)
	if p.Dst != nil {
		sel.Family = uint16(nl.GetIPFamily(p.Dst.IP))
		sel.Daddr.FromIP(p.Dst.IP)
		ones, _ := p.Dst.Mask.Size()
		sel.PrefixlenD = uint8(ones)
	}
	if p.Src != nil {
		sel.Saddr.FromIP(p.Src.IP)
		ones, _ := p.Src.Mask.Size()
		sel.PrefixlenS = uint8(ones)
	}
	sel.Proto = uint8(p.Proto)
	sel.Dport, sel.Sport = nl.Swap16(uint16(p.DstPort)), nl.Swap16(uint16(p.SrcPort))
	if sel.Dport != 0 {
		sel.DportMask = ^uint16(0)
	}
	if sel.Sport != 0 {
		sel.SportMask = ^uint16(0)
	}
	sel.Ifindex = int32(p.Ifindex)
}

func infinite() nl.XfrmLifetimeCfg {
	return nl.XfrmLifetimeCfg{SoftByteLimit: nl.XFRM_INF, HardByteLimit: nl.XFRM_INF, SoftPacketLimit: nl.XFRM_INF, HardPacketLimit: nl.XFRM_INF}
}

// mark is struct xfrm_mark; a zero mask means "all bits", as ip(8) does.
func mark(m *netlink.XfrmMark) []byte {
	v := nl.XfrmMark{Value: m.Value, Mask: m.Mask}
	if v.Mask == 0 {
		v.Mask = ^uint32(0)
	}
	return v.Serialize()
}

// Send sends b's requests in order, BatchSize per datagram (fewer if they
// would not fit the send buffer), and returns one error per request (nil:
// applied), in b's order. A request the kernel refused has its errno
// (errors.Is works), as a *KernelError when the kernel said more; a
// request whose outcome could not be read wraps ErrResultUnknown. The
// datagrams after one that was refused as a whole or whose replies could
// not all be read are not sent: their requests get that datagram's error.
// sent is the number of datagrams sent (the last one possibly refused).
// c must be an xfrm Conn (OpenXfrm).
func (c *Conn) Send(b *XfrmBatch) (errs []error, sent int) {
	errs = make([]error, len(b.ends))
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.usable(unix.NETLINK_XFRM); err != nil {
		for i := range errs {
			errs[i] = err
		}
		return errs, 0
	}
	batch := c.effectiveBatch()
	for lo := 0; lo < len(b.ends); {
		from := 0
		if lo > 0 {
			from = b.ends[lo-1]
		}
		hi := lo + 1
		for hi < len(b.ends) && hi-lo < batch && b.ends[hi]-from <= c.maxBytes {
			hi++
		}
		c.absentOK = slices.Grow(c.absentOK[:0], hi-lo)[:hi-lo]
		clear(c.absentOK)
		sendErr, lost := c.exchange(b.msgs[from:b.ends[hi-1]])
		sent++
		if sendErr != nil {
			for i := lo; i < len(errs); i++ {
				errs[i] = sendErr
			}
			return errs, sent
		}
		for p := range hi - lo {
			switch {
			case c.errs[p] != nil:
				errs[lo+p] = c.errs[p]
			case lost != nil && !c.seen[p]:
				errs[lo+p] = lost
			}
		}
		if lost != nil {
			for i := hi; i < len(errs); i++ {
				errs[i] = lost
			}
			return errs, sent
		}
		lo = hi
	}
	return errs, sent
}
