package peerdb

import "math/bits"

// sortNotes sorts notes by key, which is unique among them.
//
// It is an in-place most-significant-digit radix sort (American flag sort)
// over the bytes in which the keys differ: the keys, (subnet, IP) or
// (subnet, MAC), differ in few bytes, and it needs no scratch memory. Sorted
// input, the usual case when events arrive in address order, costs one pass.
func sortNotes(s []note) {
	for i := 1; i < len(s); i++ {
		if s[i].key < s[i-1].key {
			radixSort(s)
			return
		}
	}
}

// radixSort sorts s by the highest byte in which its keys differ, then each
// bucket recursively.
func radixSort(s []note) {
	if len(s) <= 24 {
		for i := 1; i < len(s); i++ {
			for j := i; j > 0 && s[j].key < s[j-1].key; j-- {
				s[j], s[j-1] = s[j-1], s[j]
			}
		}
		return
	}
	var diff uint64
	for i := 1; i < len(s); i++ {
		diff |= s[i].key ^ s[0].key
	}
	if diff == 0 {
		return
	}
	shift := uint(63-bits.LeadingZeros64(diff)) &^ 7

	var count [256]int32
	for i := range s {
		count[byte(s[i].key>>shift)]++
	}
	var next, end [256]int32
	var sum int32
	for b, c := range count {
		next[b] = sum
		sum += c
		end[b] = sum
	}
	// Move every element to its bucket: while the next slot of bucket b
	// holds an element of another bucket, swap it into that bucket.
	for b := range 256 {
		for next[b] < end[b] {
			i := next[b]
			d := byte(s[i].key >> shift)
			if int(d) == b {
				next[b]++
				continue
			}
			j := next[d]
			next[d]++
			s[i], s[j] = s[j], s[i]
		}
	}
	if shift == 0 {
		return
	}
	var start int32
	for _, c := range count {
		if c > 1 {
			radixSort(s[start : start+c])
		}
		start += c
	}
}
