package cluster

import "testing"

// TestStatusCountsOwnRecords: this node's member line counts the records
// it publishes (they are not in the replica, which holds the others').
func TestStatusCountsOwnRecords(t *testing.T) {
	t.Parallel()
	n := startNode(t, "own1", "127.0.0.191", 0, nodeOpts{})
	n.publish(191, n.peer("a", "10.191.0.2"))
	n.publish(192, n.peer("b", "10.192.0.2"))
	st := n.c.Status()
	if len(st.Members) != 1 || !st.Members[0].Self || st.Members[0].Records != 2 {
		t.Fatalf("members %+v, want this node with 2 records", st.Members)
	}
}
