package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"deltabox/internal/apitypes"
)

func imageImportCmd() *cobra.Command {
	var q apitypes.ImportRequest
	c := &cobra.Command{
		Use:   "import NAME SOURCE [--allow-setuid]",
		Short: "Import an image from a rootfs directory, a tar of one (gzip ok), or a docker save / OCI layout tarball",
		Long: `Import an image into the daemon's store. SOURCE is a path on the daemon's host:
a rootfs directory (copied with reflinks when it is on the store's filesystem), a tar
of one (optionally gzip'd), a 'docker save' tarball or an OCI image layout (tarball or
directory), whose layers are applied in order with their whiteouts.

Hostile archives are refused and leave nothing in the store: absolute names, "..",
symlinks climbing out of the root, anything created through a symlink, device nodes
and fifos (except under /dev, skipped), setuid/setgid files and file capabilities
(unless --allow-setuid), and more than --max-bytes of data or --max-entries entries.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			q.Name = args[0]
			src, err := filepath.Abs(args[1])
			if err != nil {
				return err
			}
			q.Source = src
			start := time.Now()
			var bar *progressBar
			var progress func(done, total int64)
			if !jsonOut && isTerminal(os.Stdout) {
				bar = &progressBar{w: os.Stdout, label: "importing " + q.Name}
				progress = bar.update
			}
			im, err := cli().ImportImage(ctx(), q, progress)
			if bar != nil {
				bar.clear()
			}
			if err != nil {
				return err
			}
			switch {
			case jsonOut:
				printJSON(im)
			case bar != nil:
				fmt.Printf("%s: %s from %s in %.1fs\n", im.Name, humanBytes(im.Bytes), im.Source, time.Since(start).Seconds())
			default:
				fmt.Println(im.Name)
			}
			return nil
		},
	}
	c.Flags().BoolVar(&q.AllowSetuid, "allow-setuid", false, "keep setuid/setgid files and file capabilities (refused otherwise)")
	c.Flags().Int64Var(&q.MaxBytes, "max-bytes", 0, "refuse an import that extracts more bytes than this (default 4 GiB)")
	c.Flags().Int64Var(&q.MaxEntries, "max-entries", 0, "refuse an import of more entries than this (default 4194304)")
	return c
}

func imageRmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove images (refused while a sandbox or a node of the tree uses one)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var errs []error
			for _, name := range args {
				if err := cli().RemoveImage(ctx(), name); err != nil {
					errs = append(errs, err)
				} else {
					fmt.Println(name)
				}
			}
			return errors.Join(errs...)
		},
	}
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// progressBar draws one line, redrawn in place, at most ten times a second.
type progressBar struct {
	w     io.Writer
	label string
	last  time.Time
	drawn bool
}

func (b *progressBar) update(done, total int64) {
	now := time.Now()
	if now.Sub(b.last) < 100*time.Millisecond && done < total {
		return
	}
	b.last = now
	width := 80
	if ws, err := unix.IoctlGetWinsize(int(os.Stdout.Fd()), unix.TIOCGWINSZ); err == nil && ws.Col > 0 {
		width = int(ws.Col)
	}
	frac := 0.0
	if total > 0 {
		frac = min(float64(done)/float64(total), 1)
	}
	text := fmt.Sprintf(" %3.0f%%  %s / %s", frac*100, humanBytes(done), humanBytes(total))
	cells := width - len(b.label) - len(text) - 4
	bar := ""
	if cells >= 10 {
		cells = min(cells, 50)
		n := int(frac * float64(cells))
		bar = " [" + strings.Repeat("#", n) + strings.Repeat(".", cells-n) + "]"
	}
	fmt.Fprintf(b.w, "\r\033[K%s%s%s", b.label, bar, text)
	b.drawn = true
}

func (b *progressBar) clear() {
	if b.drawn {
		fmt.Fprint(b.w, "\r\033[K")
	}
}
