package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// repo makes a git repository in a temporary directory tracking files.
func repo(t *testing.T, files map[string][]byte) string {
	t.Helper()
	dir := t.TempDir()
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	git("init", "-q")
	for name, data := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	git("add", ".")
	return dir
}

func normal() map[string][]byte {
	return map[string][]byte{
		"README.md":              []byte("# hello\n"),
		"cmd/overlayd/main.go":   []byte("package main\n"),
		"packaging/run.sh":       []byte("#!/bin/sh\necho hi\n"),
		"empty":                  nil,
		"testdata/exactly-1MB":   make([]byte, MaxSize),
		"testdata/mostly-binary": {0, 1, 2, 3, 4, 5},
	}
}

func TestNormalTreePasses(t *testing.T) {
	problems, err := check(repo(t, normal()))
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) != 0 {
		t.Fatalf("a normal tree was refused: %q", problems)
	}
}

func TestExecutableFails(t *testing.T) {
	self, err := os.ReadFile("/proc/self/exe") // this test binary: ELF on Linux
	if err != nil {
		t.Fatal(err)
	}
	files := normal()
	files["overlayd"] = self[:4096] // a small one: refused for what it is, not its size
	files["tool.exe"] = []byte("MZ\x90\x00rest")
	problems, err := check(repo(t, files))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"overlayd: an ELF executable", "tool.exe: a Windows (PE) executable"}
	if len(problems) != len(want) {
		t.Fatalf("problems %q, want %q", problems, want)
	}
	for i, w := range want {
		if !strings.HasPrefix(problems[i], w) {
			t.Fatalf("problem %q, want it to start with %q", problems[i], w)
		}
	}
}

func TestLargeFileFails(t *testing.T) {
	files := normal()
	files["data/big.txt"] = []byte(strings.Repeat("a", MaxSize+1))
	problems, err := check(repo(t, files))
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) != 1 || !strings.HasPrefix(problems[0], "data/big.txt: 1048577 bytes, larger than") {
		t.Fatalf("problems %q", problems)
	}
}
