// Package lockorder provides a mutex that carries its place in a lock
// hierarchy. In normal builds it is a plain sync.Mutex. Built with the
// "lockcheck" tag (the test suite is), every acquisition is checked against
// the hierarchy: a goroutine may only take a lock whose level is greater
// than the level of every lock it already holds, so taking a higher lock
// while holding a lower one, or two locks of one level (two networks) at
// once, is reported as an inversion.
package lockorder

// Levels of overlayd's lock hierarchy, top (taken first) to bottom.
const (
	LevelNetwork    = 10 // network.mu
	LevelEncryption = 20 // the encryption state lock
	LevelAlloc      = 25 // the driver's VNI allocation lock (swarm leader)
	LevelDriver     = 30 // driver.mu: bottom, never held while taking another
)

// Names of the levels, for reports.
var levelNames = map[int]string{
	LevelNetwork:    "network.mu",
	LevelEncryption: "encryption lock",
	LevelAlloc:      "allocation lock",
	LevelDriver:     "driver.mu",
}

func levelName(l int) string {
	if n, ok := levelNames[l]; ok {
		return n
	}
	return "level " + itoa(l)
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	neg := i < 0
	if neg {
		i = -i
	}
	var b [20]byte
	p := len(b)
	for i > 0 {
		p--
		b[p] = byte('0' + i%10)
		i /= 10
	}
	if neg {
		p--
		b[p] = '-'
	}
	return string(b[p:])
}
