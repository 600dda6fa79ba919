package bench

import (
	"math"
	"sort"
)

// Dist summarises samples in milliseconds. Percentiles are nearest-rank: the p-th
// percentile of n sorted samples is the ceil(p/100*n)-th smallest, so with n = 20 the
// p99 is the maximum; no interpolation.
type Dist struct {
	N    int
	P50  float64
	P95  float64
	P99  float64
	Mean float64
	Min  float64
	Max  float64
}

// Percentile returns the nearest-rank p-th percentile of sorted (ascending) samples.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	r := int(math.Ceil(p / 100 * float64(n)))
	if r < 1 {
		r = 1
	}
	if r > n {
		r = n
	}
	return sorted[r-1]
}

// Summarize computes a Dist of xs (which it does not modify).
func Summarize(xs []float64) Dist {
	if len(xs) == 0 {
		return Dist{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	var sum float64
	for _, x := range s {
		sum += x
	}
	return Dist{
		N:    len(s),
		P50:  Percentile(s, 50),
		P95:  Percentile(s, 95),
		P99:  Percentile(s, 99),
		Mean: sum / float64(len(s)),
		Min:  s[0],
		Max:  s[len(s)-1],
	}
}

// Row makes a result row of a distribution (values rounded to the microsecond).
func (d Dist) Row(system, op string, workspaceMB int, commands ...string) Row {
	return Row{
		System: system, Op: op, WorkspaceMB: workspaceMB,
		P50: us(d.P50), P95: us(d.P95), P99: us(d.P99),
		Mean: us(d.Mean), Min: us(d.Min), Max: us(d.Max),
		N: d.N, Commands: commands,
	}
}

// us rounds milliseconds to microseconds.
func us(ms float64) float64 { return math.Round(ms*1000) / 1000 }

// LayerDist summarises stack depths.
func LayerDist(depths []int) *Layers {
	if len(depths) == 0 {
		return nil
	}
	xs := make([]float64, len(depths))
	for i, d := range depths {
		xs[i] = float64(d)
	}
	d := Summarize(xs)
	return &Layers{Min: int(d.Min), P50: int(d.P50), Mean: math.Round(d.Mean*10) / 10, Max: int(d.Max)}
}

// pick is one statistic of each sample.
func pick[S any](ss []S, f func(S) float64) []float64 {
	out := make([]float64, len(ss))
	for i, s := range ss {
		out[i] = f(s)
	}
	return out
}

// phaseMedians is the median of each daemon phase (microseconds) over the samples.
func phaseMedians[S any](ss []S, phases func(S) map[string]int64) map[string]float64 {
	by := map[string][]float64{}
	for _, s := range ss {
		for k, v := range phases(s) {
			by[k] = append(by[k], float64(v))
		}
	}
	out := map[string]float64{}
	for k, v := range by {
		out[k] = Summarize(v).P50
	}
	return out
}

// tailPhases is the median of each daemon phase (microseconds) over the samples
// whose key is at or above the key's p95: where the slow 5% spend their time,
// which the medians of all samples hide.
func tailPhases[S any](ss []S, key func(S) float64, phases func(S) map[string]int64) map[string]float64 {
	if len(ss) == 0 {
		return map[string]float64{}
	}
	p95 := Summarize(pick(ss, key)).P95
	var tail []S
	for _, s := range ss {
		if key(s) >= p95 {
			tail = append(tail, s)
		}
	}
	return phaseMedians(tail, phases)
}
