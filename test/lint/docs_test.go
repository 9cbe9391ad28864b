// Package lint holds checks on the repository's files that are not Go code.
package lint

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// root is the repository's top directory, seen from this package.
const root = "../.."

// link matches an inline Markdown link's target, [text](target), and
// stops at a space so that a title ("…") is not taken as the target.
var link = regexp.MustCompile(`\]\(([^)\s]+)`)

// TestDocsLinks keeps every relative link of README.md and docs/*.md
// pointing at a file that exists and, with a #fragment, at a heading of
// that file: pages move and headings are reworded, and a dead link is
// what a reader finds first.
func TestDocsLinks(t *testing.T) {
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, filepath.Join(root, "README.md"))
	if len(pages) < 2 {
		t.Fatalf("no docs pages found beside README.md: %v", pages)
	}
	anchors := map[string]map[string]bool{}
	for _, page := range pages {
		text, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, target := range links(string(text)) {
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue // not ours to check here
			}
			file, frag, _ := strings.Cut(target, "#")
			dest := page
			if file != "" {
				dest = filepath.Join(filepath.Dir(page), file)
				if _, err := os.Stat(dest); err != nil {
					t.Errorf("%s: link %q: %v", rel(page), target, err)
					continue
				}
			}
			if frag == "" || !strings.HasSuffix(dest, ".md") {
				continue
			}
			if anchors[dest] == nil {
				b, err := os.ReadFile(dest)
				if err != nil {
					t.Fatal(err)
				}
				anchors[dest] = headingSlugs(string(b))
			}
			if !anchors[dest][frag] {
				t.Errorf("%s: link %q: %s has no heading with that anchor", rel(page), target, rel(dest))
			}
		}
	}
}

func rel(p string) string {
	r, err := filepath.Rel(root, p)
	if err != nil {
		return p
	}
	return r
}

// links returns the targets of a page's inline links outside code blocks
// and code spans, where brackets are shell or Go, not Markdown.
func links(text string) []string {
	var out []string
	fenced := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		for _, m := range link.FindAllStringSubmatch(stripCodeSpans(line), -1) {
			out = append(out, m[1])
		}
	}
	return out
}

func stripCodeSpans(line string) string {
	parts := strings.Split(line, "`")
	var b strings.Builder
	for i, p := range parts {
		if i%2 == 0 {
			b.WriteString(p)
		}
	}
	return b.String()
}

// headingSlugs returns the anchors GitHub gives a page's headings: lower
// case, punctuation dropped, spaces turned into hyphens, and a repeated
// slug numbered -1, -2, … in the order the headings come.
func headingSlugs(text string) map[string]bool {
	slugs := map[string]bool{}
	seen := map[string]int{}
	fenced := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			continue
		}
		if fenced || !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimLeft(line, "#")
		if !strings.HasPrefix(title, " ") {
			continue // "#tag", not a heading
		}
		s := slug(title)
		if n := seen[s]; n > 0 {
			slugs[s+"-"+itoa(n)] = true
		} else {
			slugs[s] = true
		}
		seen[s]++
	}
	return slugs
}

func slug(title string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(title)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func itoa(n int) string {
	const digits = "0123456789"
	if n < 10 {
		return digits[n : n+1]
	}
	return itoa(n/10) + digits[n%10:n%10+1]
}
