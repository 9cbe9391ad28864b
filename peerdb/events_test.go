package peerdb

import (
	"errors"
	"fmt"
)

// The event API is the set-semantics core under the keyed one, driven
// directly by the model and fuzz tests: a remote change is an event (prev,
// next) applied as "remove prev if present, add next".

// Event is a remote peer change as delivered by the cluster layer:
// create (nil, next), update (prev, next) or delete (prev, nil).
type Event struct{ Prev, Next *Peer }

// applyEvent applies one remote event with set semantics, so it is idempotent:
// the entry equal to *Prev is removed if present (absent is not an error: it
// may already be gone), then *Next is inserted (already present is a no-op).
// Prev and Next are validated first; on error nothing is changed. The Delta is
// the net change of desired state across the whole event, so an update that
// moves an IP to another MAC yields a single NeighSet.
func (db *DB) applyEvent(ev Event) (Delta, error) {
	sub, err := db.checkEvent(&ev)
	if err != nil {
		return Delta{}, err
	}
	db.begin()
	db.apply(&ev, sub)
	return db.finish(), nil
}

// applyEvents applies events in order, as applyEvent does. Invalid events are skipped
// and reported: errs[i] is the error of events[i], nil when it was applied,
// and errs is nil when every event was applied. The Delta is the net change
// across all events: per key, the desired value before the first event is
// compared with the value after the last, and unchanged keys are omitted.
// Its cost is proportional to the number of keys the events touch.
func (db *DB) applyEvents(events []Event) (Delta, []error) {
	db.begin()
	if len(events) > 1 {
		db.reserve(len(events), func(yield func(*Peer) bool) {
			for i := range events {
				if p := events[i].Next; p != nil && !yield(p) {
					return
				}
			}
		})
	}
	var errs []error
	for i := range events {
		ev := &events[i]
		sub, err := db.checkEvent(ev)
		if err != nil {
			if errs == nil {
				errs = make([]error, len(events))
			}
			errs[i] = fmt.Errorf("event %d: %w", i, err)
			continue
		}
		db.apply(ev, sub)
	}
	return db.finish(), errs
}

// checkEvent validates ev and returns the subnet of Next's IP.
func (db *DB) checkEvent(ev *Event) (nextSubnet int, err error) {
	if ev.Prev == nil && ev.Next == nil {
		return 0, errors.New("peerdb: event has neither Prev nor Next")
	}
	var errs []error
	if ev.Prev != nil {
		if _, err := db.validate(ev.Prev, true); err != nil {
			errs = append(errs, fmt.Errorf("prev: %w", err))
		}
	}
	if ev.Next != nil {
		sub, err := db.validate(ev.Next, true)
		if err != nil {
			errs = append(errs, fmt.Errorf("next: %w", err))
		}
		nextSubnet = sub
	}
	return nextSubnet, errors.Join(errs...)
}

func (db *DB) apply(ev *Event, nextSubnet int) {
	if ev.Prev != nil {
		db.removeRemote(ev.Prev)
	}
	if ev.Next != nil {
		db.addRemote(ev.Next, nextSubnet)
	}
}
