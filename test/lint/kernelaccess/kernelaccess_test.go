// Package kernelaccess keeps overlayd's kernel access on its one path:
// netlink handles are opened through internal/nlwrap (on a thread that
// netnsutil restores or retires), dumps go through nlwrap's retrying
// methods, and only internal/netnsutil switches a thread's namespace.
package kernelaccess

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const root = "../../.."

// dumps are netlink's dump calls, which return a partial result with
// ErrDumpInterrupted when the table changes under them.
var dumps = []string{"LinkList", "AddrList", "NeighList", "RouteList", "RouteListFiltered", "XfrmStateList", "XfrmPolicyList",
	"RuleList", "BridgeVlanList", "QdiscList", "ClassList", "FilterList", "ConntrackTableList", "LinkListExecute"}

// Check reports the raw kernel accesses of one Go file (its path relative
// to the repository, for the exemptions).
func Check(fset *token.FileSet, f *ast.File, rel string) []string {
	var out []string
	pos := func(n ast.Node) string { return fset.Position(n.Pos()).String() }
	inNlwrap := strings.HasPrefix(rel, "internal/nlwrap/")
	inNetnsutil := strings.HasPrefix(rel, "internal/netnsutil/")
	var stack []ast.Node
	ast.Inspect(f, func(n ast.Node) bool {
		if n == nil {
			stack = stack[:len(stack)-1]
			return true
		}
		stack = append(stack, n)
		switch x := n.(type) {
		case *ast.SelectorExpr:
			pkg, ok := x.X.(*ast.Ident)
			name := x.Sel.Name
			switch {
			case ok && pkg.Name == "netlink" && (name == "NewHandleAt" || name == "NewHandle" || name == "NewHandleAtFrom") && !inNlwrap:
				out = append(out, fmt.Sprintf("%s: netlink.%s: open handles with nlwrap.NewHandleAt (netnsutil restores or retires the thread)", pos(x), name))
			case ok && pkg.Name == "netlink" && name == "Handle" && !inNlwrap:
				out = append(out, fmt.Sprintf("%s: netlink.Handle: use *nlwrap.Handle (its dumps are retried on interruption)", pos(x)))
			case ok && pkg.Name == "netlink" && slices.Contains(dumps, name) && !inNlwrap && !insideRetry(stack):
				out = append(out, fmt.Sprintf("%s: netlink.%s: a dump outside nlwrap.Retry (an interrupted dump returns a partial result)", pos(x), name))
			case ok && pkg.Name == "netns" && (name == "Set" || name == "New" || name == "NewNamed") && !inNetnsutil:
				out = append(out, fmt.Sprintf("%s: netns.%s: switch namespaces only through internal/netnsutil", pos(x), name))
			}
		}
		return true
	})
	return out
}

// insideRetry reports whether the innermost function literal on the stack
// is an argument of nlwrap.Retry.
func insideRetry(stack []ast.Node) bool {
	for i := len(stack) - 1; i > 0; i-- {
		lit, ok := stack[i].(*ast.FuncLit)
		if !ok {
			continue
		}
		call, ok := stack[i-1].(*ast.CallExpr)
		if !ok {
			return false
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return false
		}
		pkg, ok := sel.X.(*ast.Ident)
		return ok && pkg.Name == "nlwrap" && sel.Sel.Name == "Retry" && slices.Contains(call.Args, ast.Expr(lit))
	}
	return false
}

// product reports whether rel is product code: not a test, not a test
// suite or helper, not a bench command.
func product(rel string) bool {
	return strings.HasSuffix(rel, ".go") && !strings.HasSuffix(rel, "_test.go") &&
		!strings.HasPrefix(rel, "test/") && !strings.HasPrefix(rel, "bench/") && !strings.HasPrefix(rel, "internal/testutil/")
}

func TestKernelAccessThroughWrappers(t *testing.T) {
	fset := token.NewFileSet()
	var problems []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			if strings.HasPrefix(d.Name(), ".") && rel != "." {
				return filepath.SkipDir
			}
			return nil
		}
		if !product(rel) {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		f, err := parser.ParseFile(fset, rel, src, 0)
		if err != nil {
			return err
		}
		problems = append(problems, Check(fset, f, rel)...)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
}

// Each rule fails on a planted violation, and the allowed forms pass.
func TestRulesCatchPlantedViolations(t *testing.T) {
	for _, c := range []struct {
		src  string
		rel  string
		want int
	}{
		{`package p; func f() { netlink.NewHandleAt(ns) }`, "driver/x.go", 1},
		{`package p; var h *netlink.Handle`, "driver/x.go", 1},
		{`package p; func f() { netlink.LinkList() }`, "driver/x.go", 1},
		{`package p; func f() { nlwrap.Retry(func() ([]netlink.Link, error) { return netlink.LinkList() }) }`, "driver/x.go", 0},
		{`package p; func f() { nlwrap.Retry(func() ([]netlink.Link, error) { go func() { netlink.LinkList() }(); return nil, nil }) }`, "driver/x.go", 1},
		{`package p; func f() { h.NeighList(1, 2) }`, "internal/sandbox/x.go", 0},
		{`package p; func f() { netns.Set(ns) }`, "encryption/x.go", 1},
		{`package p; func f() { netns.Set(ns) }`, "internal/netnsutil/x.go", 0},
		{`package p; func f() { netlink.NewHandle() }`, "internal/nlwrap/x.go", 0},
	} {
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, c.rel, c.src, 0)
		if err != nil {
			t.Fatal(err)
		}
		if got := Check(fset, f, c.rel); len(got) != c.want {
			t.Errorf("%s in %s: %d problems %v, want %d", c.src, c.rel, len(got), got, c.want)
		}
	}
}
