package main

import (
	"io"
	"strings"
	"unicode/utf8"
)

// table lays rows out in columns two spaces apart by the width a terminal
// shows. text/tabwriter counts bytes, so each colour escape pair (9 bytes,
// no width on screen) put every coloured column 9 columns off.
type table struct{ rows [][]string }

func (t *table) row(cells ...string) { t.rows = append(t.rows, cells) }

// write prints the rows, each after indent; the last cell of a row is not
// padded, so no line ends in spaces.
func (t *table) write(w io.Writer, indent string) {
	var widths []int
	for _, r := range t.rows {
		for i, c := range r {
			if i == len(widths) {
				widths = append(widths, 0)
			}
			widths[i] = max(widths[i], visibleWidth(c))
		}
	}
	var b strings.Builder
	for _, r := range t.rows {
		b.WriteString(indent)
		for i, c := range r {
			b.WriteString(c)
			if i < len(r)-1 {
				b.WriteString(strings.Repeat(" ", widths[i]-visibleWidth(c)+2))
			}
		}
		b.WriteByte('\n')
	}
	io.WriteString(w, b.String())
}

// visibleWidth is the columns s takes on a terminal: its runes, less the
// ANSI escape sequences (ESC [ parameters, then a final byte in @–~).
func visibleWidth(s string) int {
	n := 0
	for i := 0; i < len(s); {
		if s[i] == '\x1b' && i+1 < len(s) && s[i+1] == '[' {
			j := i + 2
			for j < len(s) && (s[j] < 0x40 || s[j] > 0x7e) {
				j++
			}
			i = j + 1
			continue
		}
		_, size := utf8.DecodeRuneInString(s[i:])
		i += size
		n++
	}
	return n
}
