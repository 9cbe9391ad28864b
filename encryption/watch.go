package encryption

import (
	"errors"
	"os"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Kernel notifications. Two watchers tell the loop that something may have
// changed in the namespace; the loop then reconciles (after debounce). They
// carry no information the loop relies on: any message, any error, a lost
// message (ENOBUFS) all just mean "look now". Our own changes are echoed
// back too, which costs one more reconcile that finds nothing to do and so
// changes nothing and is echoed no further.

// kernelEvent wakes the loop for a kernel notification; it never blocks.
func (o *Owner) kernelEvent() {
	select {
	case o.kev <- struct{}{}:
	default:
	}
}

// watchRetry is how long a watcher waits before re-opening its socket after
// an error (the tick keeps reconciling meanwhile).
const watchRetry = 200 * time.Millisecond

// startWatchers starts the xfrm and nftables watchers; Close stops them.
func (o *Owner) startWatchers() {
	o.done.Add(2)
	go o.watchXfrm()
	go o.watchNft()
}

// sleepOrStop waits d; it reports false when the Owner is stopping.
func (o *Owner) sleepOrStop(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-o.stop:
		return false
	case <-t.C:
		return true
	}
}

// watchXfrm listens on a NETLINK_XFRM socket in the namespace subscribed
// to XFRMNLGRP_SA and XFRMNLGRP_POLICY: every SA and policy added,
// updated, deleted, expired or flushed, by anyone.
func (o *Owner) watchXfrm() {
	defer o.done.Done()
	for {
		sock, err := nl.SubscribeAt(o.ns, netns.None(), unix.NETLINK_XFRM, nl.XFRMNLGRP_SA, nl.XFRMNLGRP_POLICY)
		if err != nil {
			o.log.Warn("cannot subscribe to xfrm notifications (the tick keeps reconciling)", "error", err)
			if !o.sleepOrStop(watchRetry) {
				return
			}
			continue
		}
		closed := make(chan struct{})
		go func() {
			select {
			case <-o.stop:
			case <-closed:
			}
			sock.Close() // unblocks Receive
		}()
		for {
			_, _, err := sock.Receive()
			select {
			case <-o.stop:
				close(closed)
				return
			default:
			}
			o.kernelEvent()
			if err == nil || errors.Is(err, unix.ENOBUFS) || errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
				continue
			}
			if !errors.Is(err, os.ErrClosed) {
				o.log.Warn("xfrm notifications failed; re-subscribing", "error", err)
			}
			break
		}
		close(closed)
		if !o.sleepOrStop(watchRetry) {
			return
		}
	}
}

// watchNft runs google/nftables' Monitor in the namespace: one batch per
// nftables transaction (ours, `nft flush ruleset`, a firewall reload…).
func (o *Owner) watchNft() {
	defer o.done.Done()
	for {
		conn, err := nftables.New(nftables.WithNetNSFd(int(o.ns)))
		var ch chan *nftables.MonitorEvents
		var mon *nftables.Monitor
		if err == nil {
			mon = nftables.NewMonitor(nftables.WithMonitorEventBuffer(64))
			ch, err = conn.AddGenerationalMonitor(mon)
		}
		if err != nil {
			o.log.Warn("cannot monitor nftables (the tick keeps reconciling)", "error", err)
			if !o.sleepOrStop(watchRetry) {
				return
			}
			continue
		}
	events:
		for {
			select {
			case <-o.stop:
				mon.Close()
				for range ch {
				}
				return
			case evs, ok := <-ch:
				o.kernelEvent()
				if !ok {
					break events
				}
				if evs != nil && evs.GeneratedBy != nil && evs.GeneratedBy.Error != nil && evs.GeneratedBy.Type == nftables.MonitorEventTypeOOB {
					o.log.Warn("nftables monitor failed; re-opening", "error", evs.GeneratedBy.Error)
				}
			}
		}
		mon.Close()
		if !o.sleepOrStop(watchRetry) {
			return
		}
	}
}
