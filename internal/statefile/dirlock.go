package statefile

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// lockTimeout is how long Open waits for another process to release the
// state directory (an overlayd that is still stopping).
const lockTimeout = 2 * time.Second

// lockDir takes an exclusive flock on the state directory dir, held until
// the returned file is closed. Open reads the state file itself before
// bbolt opens (and locks) it; without this lock a second overlayd could
// read a meta page halfway through the first one's write and call the
// file damaged, where it is only in use.
func lockDir(dir string) (*os.File, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("failed to open state directory %s: %w", dir, err)
	}
	for deadline := time.Now().Add(lockTimeout); ; time.Sleep(50 * time.Millisecond) {
		err := unix.Flock(int(d.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return d, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			d.Close()
			return nil, fmt.Errorf("failed to lock state directory %s: %w", dir, err)
		}
		if time.Now().After(deadline) {
			d.Close()
			return nil, fmt.Errorf("state directory %s is locked by another process (is another overlayd running with --state-dir %s?)", dir, dir)
		}
	}
}
