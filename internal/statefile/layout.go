package statefile

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
)

// bbolt trusts the file it maps: it reads every page its meta pages point
// at, so a file cut short makes it read past the end of the mapping, a
// SIGBUS that no recover catches (the process dies with a traceback); and
// when its newest meta page does not validate it uses the older one
// without a word, so the file silently loses its last transaction. The
// checks here read the two meta pages themselves before bbolt opens the
// file and refuse such a file with a CorruptError.
//
// A meta page as bbolt (file format version 2) writes it, every field in
// the machine's byte order:
//
//	page header (16 bytes): page id u64, flags u16, count u16, overflow u32
//	meta (64 bytes):        magic u32, version u32, page size u32, flags u32,
//	                        root bucket: page id u64, sequence u64,
//	                        freelist page id u64, high-water mark u64 (the
//	                        first page id not yet in use), txid u64,
//	                        checksum u64: FNV-64a of the 56 bytes before it
//
// Meta page 0 is at offset 0, meta page 1 one page further; transaction
// txid writes meta page txid%2, so the two hold the last two transactions.
const (
	pageHeaderSize = 16
	metaSize       = 64
	metaSummed     = 56 // bytes of the meta the checksum covers
	boltMagic      = 0xED0CDAED
	boltVersion    = 2
	noFreelist     = ^uint64(0) // freelist page id of a file that keeps none
	// Page sizes bbolt may have used; it looks for meta page 1 at each of
	// them when meta page 0 cannot say.
	minPageSize = 1 << 10
	maxPageSize = 1 << 24
)

// boltMeta is what a valid meta page says.
type boltMeta struct {
	pageSize            uint64
	root, freelist, hwm uint64 // page ids
	txid                uint64
}

// pagesEnd is how many bytes the file must have to hold every page m
// refers to.
func (m boltMeta) pagesEnd() uint64 {
	end := max(m.hwm, m.root+1)
	if m.freelist != noFreelist {
		end = max(end, m.freelist+1)
	}
	return end * m.pageSize
}

// decodeMeta reads the meta page at the start of b; the error says why it
// is not valid.
func decodeMeta(b []byte) (boltMeta, error) {
	if len(b) < pageHeaderSize+metaSize {
		return boltMeta{}, fmt.Errorf("is cut short (%d of its %d bytes are in the file)", len(b), pageHeaderSize+metaSize)
	}
	m := b[pageHeaderSize : pageHeaderSize+metaSize]
	order := binary.NativeEndian
	if magic := order.Uint32(m[0:]); magic != boltMagic {
		return boltMeta{}, fmt.Errorf("lacks bbolt's marker (%#08x where %#08x belongs)", magic, uint32(boltMagic))
	}
	if v := order.Uint32(m[4:]); v != boltVersion {
		return boltMeta{}, fmt.Errorf("has format version %d, not %d", v, boltVersion)
	}
	h := fnv.New64a()
	h.Write(m[:metaSummed])
	if stored, sum := order.Uint64(m[metaSummed:]), h.Sum64(); stored != sum {
		return boltMeta{}, fmt.Errorf("fails its checksum (%016x stored, %016x computed)", stored, sum)
	}
	meta := boltMeta{
		pageSize: uint64(order.Uint32(m[8:])),
		root:     order.Uint64(m[16:]),
		freelist: order.Uint64(m[32:]),
		hwm:      order.Uint64(m[40:]),
		txid:     order.Uint64(m[48:]),
	}
	if ps := meta.pageSize; ps < minPageSize || ps > maxPageSize || ps&(ps-1) != 0 {
		return boltMeta{}, fmt.Errorf("gives a page size of %d bytes, not a power of two from %d to %d", ps, minPageSize, maxPageSize)
	}
	return meta, nil
}

// layout is what the meta pages of a file that passed checkLayout say.
type layout struct {
	pageSize uint64
	// txid is the transaction bbolt will open: the newest of a valid
	// meta page.
	txid uint64
	// damaged is the meta page (0 or 1) that is not valid, or -1; why
	// says what is wrong with it.
	damaged int
	why     error
}

// fileDamage is what is wrong with the state file as a whole (rather than
// with a record in it): what follows "state file <path>" in the
// CorruptError's message; advice, when set, replaces the usual recovery
// steps.
type fileDamage struct {
	what   string
	advice string
}

func (d *fileDamage) Error() string { return d.what }

// checkLayout reads the meta pages of the state file f, size bytes long,
// and refuses a file that bbolt could not open safely: no valid meta page,
// or a file shorter than the pages they refer to (a *fileDamage). A file
// with one valid meta page passes, its layout saying which one is not.
func checkLayout(f *os.File, size int64) (layout, error) {
	read := func(off uint64) (boltMeta, error) {
		buf := make([]byte, pageHeaderSize+metaSize)
		if off >= uint64(size) {
			return boltMeta{}, errors.New("is past the end of the file")
		}
		n, err := f.ReadAt(buf, int64(off))
		if err != nil && !errors.Is(err, io.EOF) {
			return boltMeta{}, err
		}
		return decodeMeta(buf[:n])
	}
	var metas [2]boltMeta
	var errs [2]error
	metas[0], errs[0] = read(0)
	if errs[0] == nil {
		metas[1], errs[1] = read(metas[0].pageSize)
		if errs[1] == nil && metas[1].pageSize != metas[0].pageSize {
			errs[1] = fmt.Errorf("gives a page size of %d bytes, page 0 %d", metas[1].pageSize, metas[0].pageSize)
		}
	} else {
		// Without page 0 the page size is unknown: meta page 1 is where
		// one of the possible sizes puts it, and says that size.
		found := false
		for ps := uint64(minPageSize); ps <= maxPageSize && !found; ps <<= 1 {
			if m, err := read(ps); err == nil && m.pageSize == ps {
				metas[1], found = m, true
			}
		}
		if !found {
			// Say what is wrong where this machine's page size puts it.
			_, errs[1] = read(uint64(os.Getpagesize()))
			if errs[1] == nil {
				errs[1] = errors.New("gives another page size than its place in the file")
			}
		}
	}
	if errs[0] != nil && errs[1] != nil {
		return layout{}, &fileDamage{what: fmt.Sprintf("has no valid meta page (bbolt's two headers that say where the data is): page 0 %v; page 1 %v; "+
			"the file was cut short or overwritten, or is not a state file", errs[0], errs[1])}
	}
	l := layout{damaged: -1}
	var need uint64
	for i, m := range metas {
		if errs[i] != nil {
			l.damaged, l.why = i, errs[i]
			continue
		}
		l.pageSize = m.pageSize
		l.txid = max(l.txid, m.txid)
		need = max(need, m.pagesEnd())
	}
	if uint64(size) < need {
		return layout{}, &fileDamage{what: fmt.Sprintf("is truncated: %d of the %d bytes its last transaction needs are in the file", size, need)}
	}
	return l, nil
}

// checkFile runs checkLayout on the state file at path.
func checkFile(path string) (layout, error) {
	f, err := os.Open(path)
	if err != nil {
		return layout{}, fmt.Errorf("failed to open state file %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return layout{}, fmt.Errorf("failed to check state file %s: %w", path, err)
	}
	l, err := checkLayout(f, fi.Size())
	if _, ok := errors.AsType[*fileDamage](err); ok {
		return layout{}, &CorruptError{Path: path, Err: err}
	}
	if err != nil {
		return layout{}, fmt.Errorf("failed to read state file %s: %w", path, err)
	}
	return l, nil
}
