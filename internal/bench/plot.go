package bench

import (
	"bytes"
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Figures of the report: SVGs written by `deltabox bench report` into a plots
// directory next to the markdown, and linked from each bench's section. They depend
// only on the JSON results (no generation time inside), so the same inputs give the
// same files.

// Figure is one SVG of the report.
type Figure struct {
	File    string // file name in the plots directory
	Title   string // alt text and first title line
	Caption string // machine, samples and date: under the title in the SVG and under the link
	render  func() (*plot.Plot, vg.Length, vg.Length, error)
	raw     func() ([]byte, error) // an SVG drawn without gonum (the mcts tree)
}

// PlotsDir is where the figures go, relative to the markdown file.
const PlotsDir = "plots"

// SVG renders the figure.
func (fg Figure) SVG() ([]byte, error) {
	if fg.raw != nil {
		return fg.raw()
	}
	p, w, h, err := fg.render()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", fg.File, err)
	}
	p.Title.Text = fg.Title + "\n" + fg.Caption
	c := vgsvg.New(w, h)
	p.Draw(draw.New(c))
	var b bytes.Buffer
	if _, err := c.WriteTo(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// Figures returns the figures of one bench file (name is where it came from, as in
// Markdown): for bench scale, latency against each dimension it measured; for any
// other bench with latency rows, p50 by system and op.
func Figures(f *File, name string) []Figure {
	base := f.Bench
	if name != "" {
		base = strings.TrimSuffix(filepath.Base(name), ".json")
	}
	if strings.HasPrefix(f.Bench, "mcts") {
		return mctsTreeFigures(f, base)
	}
	if f.Bench == "scale" {
		var out []Figure
		for _, d := range []struct{ dim, what, file string }{
			{"depth", "tree depth", "depth"},
			{"ws", "workspace size", "workspace"},
			{"rss", "python session heap", "rss"},
		} {
			pts := scaleSeries(f.Results, d.dim)
			if len(pts) == 0 {
				continue
			}
			d := d
			out = append(out, Figure{
				File:    base + "-" + d.file + ".svg",
				Title:   "bench scale: latency against " + d.what,
				Caption: figureCaption(f, pts.rows()),
				render:  func() (*plot.Plot, vg.Length, vg.Length, error) { return scalePlot(pts, d.dim) },
			})
		}
		return out
	}
	var rows []Row
	for _, r := range f.Results {
		// Rows that hold bytes, not ms (bench durable's image sizes), are no latency.
		if u, _ := r.Info["unit"].(string); strings.HasPrefix(u, "bytes") {
			continue
		}
		if r.N > 0 && r.P50 > 0 {
			rows = append(rows, r)
		}
	}
	if len(rows) == 0 {
		return nil
	}
	return []Figure{{
		File:    base + "-p50.svg",
		Title:   "bench " + f.Bench + ": p50 latency by system and op",
		Caption: figureCaption(f, rows),
		render:  func() (*plot.Plot, vg.Length, vg.Length, error) { return barPlot(rows) },
	}}
}

// figureCaption states the machine, the samples per row and the date of a run.
func figureCaption(f *File, rows []Row) string {
	m := f.Machine
	mach := m.Kernel
	if i := strings.Index(mach, "-"); i > 0 { // Linux 6.18.44-fc-v1045 x86_64 -> Linux 6.18.44 x86_64
		if j := strings.LastIndex(mach, " "); j > i {
			mach = mach[:i] + mach[j:]
		}
	}
	mach += fmt.Sprintf(", %d CPUs", m.CPUs)
	if m.MemMB > 0 {
		mach += fmt.Sprintf(", %.0f GiB", float64(m.MemMB)/1024)
	}
	lo, hi := 0, 0
	for _, r := range rows {
		if lo == 0 || r.N < lo {
			lo = r.N
		}
		hi = max(hi, r.N)
	}
	n := fmt.Sprintf("n = %d samples per bar", lo)
	if f.Bench == "scale" {
		n = fmt.Sprintf("n = %d samples per point", lo)
	}
	if hi != lo {
		n = fmt.Sprintf("n = %d-%d samples", lo, hi)
	}
	date := m.Date
	if !f.Started.IsZero() {
		date = f.Started.UTC().Format("2006-01-02")
	} else if len(date) > 10 {
		date = date[:10]
	}
	parts := []string{mach, n, date}
	if m.Revision != "" {
		parts = append(parts, "deltabox "+m.Revision)
	}
	return strings.Join(parts, "; ")
}

// ---- scale: lines ----

type scaleXY struct {
	x   int
	row Row
}

// scaleLines are one dimension's rows by op, sorted by x.
type scaleLines map[string][]scaleXY

func (s scaleLines) rows() []Row {
	var out []Row
	for _, op := range sortedKeys(s) {
		for _, p := range s[op] {
			out = append(out, p.row)
		}
	}
	return out
}

// scaleSeries collects the checkpoint, restore and restore-cold rows of dim.
func scaleSeries(rows []Row, dim string) scaleLines {
	out := scaleLines{}
	for _, r := range rows {
		p, ok := ParseScaleSystem(r.System)
		if !ok || p.Dim != dim || r.N == 0 {
			continue
		}
		switch r.Op {
		case "checkpoint", "restore", "restore-cold":
			out[r.Op] = append(out[r.Op], scaleXY{p.X, r})
		}
	}
	for _, v := range out {
		sort.Slice(v, func(i, j int) bool { return v[i].x < v[j].x })
	}
	return out
}

var (
	colRestore = color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}
	colCold    = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
	colCkpt    = color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}
)

func scalePlot(lines scaleLines, dim string) (*plot.Plot, vg.Length, vg.Length, error) {
	p := plot.New()
	p.Y.Label.Text = "latency through the API (ms)"
	switch dim {
	case "depth":
		p.X.Label.Text = "depth of the node (layers in its stack)"
	case "ws":
		p.X.Label.Text = "workspace (files written in the sandbox)"
	case "rss":
		p.X.Label.Text = "heap of the python session"
	}
	leg := &legendIn{plot.NewLegend()}
	leg.Top, leg.Left = true, true
	leg.TextStyle.Font.Size = vg.Points(10)
	leg.XOffs, leg.YOffs = vg.Points(6), -vg.Points(4)
	p.Add(plotter.NewGrid())
	var xs []int
	seen := map[int]bool{}
	lo, hi := math.Inf(1), 0.0
	for _, s := range []struct {
		op, name string
		col      color.Color
	}{
		{"restore", "restore", colRestore},
		{"restore-cold", "restore, cold (no warm state)", colCold},
		{"checkpoint", "checkpoint", colCkpt},
	} {
		pts := lines[s.op]
		if len(pts) == 0 {
			continue
		}
		for _, stat := range []string{"p50", "p99"} {
			xy := make(plotter.XYs, len(pts))
			for i, q := range pts {
				v := q.row.P50
				if stat == "p99" {
					v = q.row.P99
				}
				xy[i] = plotter.XY{X: float64(q.x), Y: v}
				lo, hi = math.Min(lo, v), math.Max(hi, v)
				if !seen[q.x] {
					seen[q.x] = true
					xs = append(xs, q.x)
				}
			}
			l, sc, err := plotter.NewLinePoints(xy)
			if err != nil {
				return nil, 0, 0, err
			}
			l.Color, sc.Color = s.col, s.col
			l.Width = vg.Points(1.5)
			sc.Shape = draw.CircleGlyph{}
			if stat == "p99" {
				l.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
				sc.Shape = draw.RingGlyph{}
			}
			p.Add(l, sc)
			leg.Add(s.name+" "+stat, l, sc)
		}
	}
	if len(xs) == 0 {
		return nil, 0, 0, fmt.Errorf("no rows")
	}
	p.Add(leg)
	sort.Ints(xs)
	var ticks []plot.Tick
	for _, x := range xs {
		lab := strconv.Itoa(x)
		if dim != "depth" {
			lab = mbCell(x)
		}
		ticks = append(ticks, plot.Tick{Value: float64(x), Label: lab})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	if dim != "depth" && xs[len(xs)-1] > 4*xs[0] {
		p.X.Scale = plot.LogScale{}
		p.X.Min, p.X.Max = float64(xs[0])/1.4, float64(xs[len(xs)-1])*1.4
	} else {
		p.X.Min, p.X.Max = 0, float64(xs[len(xs)-1])*1.04
	}
	// The top third of the plot is left to the legend (top left).
	if hi > 20*lo && lo > 0 {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = logTicks{}
		// gonum centres the label at the arithmetic mean of the range, high up on a log
		// axis: a short one keeps the plot from shrinking under it.
		p.Y.Label.Text = "ms, log scale"
		p.Y.Min = lo / 1.5
		p.Y.Max = hi * math.Pow(hi/p.Y.Min, 0.35/0.65)
	} else {
		p.Y.Min, p.Y.Max = 0, hi*1.7
	}
	return p, 7 * vg.Inch, 5 * vg.Inch, nil
}

// legendIn draws a legend inside the data area (a plot's own legend is placed
// against the whole plot, over the axes' padding).
type legendIn struct{ plot.Legend }

func (l *legendIn) Plot(c draw.Canvas, _ *plot.Plot) { l.Draw(c) }

// logTicks labels 1-2-5 steps of each decade over at most three decades, else
// the powers of ten.
type logTicks struct{}

func (logTicks) Ticks(min, max float64) []plot.Tick {
	var out []plot.Tick
	steps := []float64{1, 2, 5}
	if max > 1000*min {
		steps = []float64{1}
	}
	for e := math.Floor(math.Log10(min)); e <= math.Ceil(math.Log10(max)); e++ {
		for _, m := range steps {
			v := m * math.Pow(10, e)
			if v < min || v > max {
				continue
			}
			out = append(out, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'g', -1, 64)})
		}
	}
	return out
}

// ---- other benches: bars ----

// hbars draws horizontal bars from the value axis' minimum (so that a log scale
// works), with the value written after each bar.
type hbars struct {
	vals   []float64
	colors []color.Color
	width  vg.Length
	label  text.Style
}

func (b *hbars) Plot(c draw.Canvas, plt *plot.Plot) {
	trX, trY := plt.Transforms(&c)
	x0 := trX(plt.X.Min)
	for i, v := range b.vals {
		y := trY(float64(i))
		x1 := trX(v)
		pts := []vg.Point{{X: x0, Y: y - b.width/2}, {X: x0, Y: y + b.width/2}, {X: x1, Y: y + b.width/2}, {X: x1, Y: y - b.width/2}}
		c.FillPolygon(b.colors[i], c.ClipPolygonXY(pts))
		c.FillText(b.label, vg.Point{X: x1 + vg.Points(3), Y: y}, fmtMS(v))
	}
}

func (b *hbars) DataRange() (xmin, xmax, ymin, ymax float64) {
	xmin, xmax = math.Inf(1), math.Inf(-1)
	for _, v := range b.vals {
		xmin, xmax = math.Min(xmin, v), math.Max(xmax, v)
	}
	return xmin, xmax, -0.5, float64(len(b.vals)) - 0.5
}

var systemColors = []color.Color{
	colRestore,
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	colCold,
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	colCkpt,
}

// barPlot draws one bar per row (p50), the first row at the top, one colour per system.
func barPlot(rows []Row) (*plot.Plot, vg.Length, vg.Length, error) {
	p := plot.New()
	p.X.Label.Text = "p50 latency (ms)"
	n := len(rows)
	b := &hbars{width: vg.Points(11), label: p.X.Tick.Label}
	b.label.XAlign, b.label.YAlign = draw.XLeft, draw.YCenter
	sysColor := map[string]color.Color{}
	var ticks []plot.Tick
	lo, hi := math.Inf(1), 0.0
	for _, r := range rows {
		if sysColor[r.System] == nil {
			sysColor[r.System] = systemColors[len(sysColor)%len(systemColors)]
		}
	}
	for i := n - 1; i >= 0; i-- { // bottom to top
		r := rows[i]
		b.vals = append(b.vals, r.P50)
		b.colors = append(b.colors, sysColor[r.System])
		lab := r.System + " " + r.Op
		if r.WorkspaceMB != 0 {
			lab += ", " + mbCell(r.WorkspaceMB)
		}
		ticks = append(ticks, plot.Tick{Value: float64(n - 1 - i), Label: lab})
		lo, hi = math.Min(lo, r.P50), math.Max(hi, r.P50)
	}
	p.Add(plotter.NewGrid(), b)
	p.Y.Tick.Marker = plot.ConstantTicks(ticks)
	p.Y.Tick.Length = 0
	if hi > 100*lo {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = logTicks{}
		p.X.Min, p.X.Max = math.Pow(10, math.Floor(math.Log10(lo))), hi*6
		p.X.Label.Text += ", log scale"
	} else {
		p.X.Min, p.X.Max = 0, hi*1.2
	}
	return p, 7.5 * vg.Inch, vg.Length(n)*vg.Points(17) + 1.6*vg.Inch, nil
}
