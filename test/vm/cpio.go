package vm

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
)

// initramfs is an in-memory description of a cpio "newc" archive, the
// format the kernel unpacks as its initial root file system. Entries are
// written in path order; parent directories are added automatically.
type initramfs struct {
	entries map[string]cpioEntry
}

type cpioEntry struct {
	mode      uint32 // type and permission bits
	source    string // host file to copy (regular files), or
	data      []byte // literal content
	rdevMajor uint32 // for device nodes
	rdevMinor uint32
}

const (
	sIFDIR = 0o040000
	sIFREG = 0o100000
	sIFCHR = 0o020000
	sIFLNK = 0o120000
)

func newInitramfs() *initramfs { return &initramfs{entries: map[string]cpioEntry{}} }

func (f *initramfs) mkdirAll(p string) {
	p = strings.Trim(path.Clean("/"+p), "/")
	if p == "" || p == "." {
		return
	}
	f.mkdirAll(path.Dir(p))
	if _, ok := f.entries[p]; !ok {
		f.entries[p] = cpioEntry{mode: sIFDIR | 0o755}
	}
}

func (f *initramfs) addFile(p string, mode uint32, source string) {
	p = strings.Trim(path.Clean("/"+p), "/")
	f.mkdirAll(path.Dir(p))
	f.entries[p] = cpioEntry{mode: sIFREG | mode, source: source}
}

func (f *initramfs) addData(p string, mode uint32, data []byte) {
	p = strings.Trim(path.Clean("/"+p), "/")
	f.mkdirAll(path.Dir(p))
	f.entries[p] = cpioEntry{mode: sIFREG | mode, data: data}
}

func (f *initramfs) addCharDev(p string, major, minor uint32) {
	p = strings.Trim(path.Clean("/"+p), "/")
	f.mkdirAll(path.Dir(p))
	f.entries[p] = cpioEntry{mode: sIFCHR | 0o600, rdevMajor: major, rdevMinor: minor}
}

// writeTo writes the archive to file name.
func (f *initramfs) writeFile(name string) (int64, error) {
	out, err := os.Create(name)
	if err != nil {
		return 0, err
	}
	w := &countWriter{w: bufio.NewWriterSize(out, 1<<20)}
	err = f.write(w)
	if err == nil {
		err = w.w.(*bufio.Writer).Flush()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return w.n, err
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func (f *initramfs) write(w *countWriter) error {
	names := make([]string, 0, len(f.entries))
	for n := range f.entries {
		names = append(names, n)
	}
	sort.Strings(names) // parents sort before their children
	ino := uint32(1)
	for _, name := range names {
		e := f.entries[name]
		var size int64
		var src *os.File
		switch {
		case e.mode&sIFREG == sIFREG && e.source != "":
			var err error
			src, err = os.Open(e.source)
			if err != nil {
				return err
			}
			st, err := src.Stat()
			if err != nil {
				src.Close()
				return err
			}
			size = st.Size()
		case e.mode&sIFREG == sIFREG:
			size = int64(len(e.data))
		}
		if err := writeHeader(w, ino, e, name, size); err != nil {
			if src != nil {
				src.Close()
			}
			return err
		}
		ino++
		if src != nil {
			n, err := io.Copy(w, src)
			src.Close()
			if err != nil {
				return err
			}
			if n != size {
				return fmt.Errorf("initramfs: %s changed size while copying", e.source)
			}
		} else if size > 0 {
			if _, err := w.Write(e.data); err != nil {
				return err
			}
		}
		if err := pad4(w); err != nil {
			return err
		}
	}
	if err := writeHeader(w, 0, cpioEntry{}, "TRAILER!!!", 0); err != nil {
		return err
	}
	// Pad the archive to 512 bytes like cpio(1) does.
	if r := w.n % 512; r != 0 {
		_, err := w.Write(make([]byte, 512-r))
		return err
	}
	return nil
}

func writeHeader(w *countWriter, ino uint32, e cpioEntry, name string, size int64) error {
	nlink := uint32(1)
	if e.mode&sIFDIR == sIFDIR {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		ino, e.mode, 0, 0, nlink, 0, uint32(size), 0, 0, e.rdevMajor, e.rdevMinor, len(name)+1, 0)
	if _, err := io.WriteString(w, hdr+name+"\x00"); err != nil {
		return err
	}
	return pad4(w)
}

func pad4(w *countWriter) error {
	if r := w.n % 4; r != 0 {
		_, err := w.Write(make([]byte, 4-r))
		return err
	}
	return nil
}
