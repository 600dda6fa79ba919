package main

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"deltabox/internal/state"
)

func treeCmd() *cobra.Command {
	c := &cobra.Command{
		Use:   "tree",
		Short: "Print the snapshot tree and where each sandbox stands",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			t, err := cli().Tree(ctx())
			if err != nil {
				return err
			}
			if jsonOut {
				printJSON(t)
				return nil
			}
			printTree(t)
			return nil
		},
	}
	c.AddCommand(&cobra.Command{
		Use:   "rm NODE",
		Short: "Remove a node and its subtree (refused while a sandbox stands in it)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			removed, err := cli().RemoveNode(ctx(), args[0])
			if err != nil {
				return err
			}
			fmt.Printf("removed %d node(s): %s\n", len(removed), strings.Join(removed, " "))
			return nil
		},
	})
	return c
}

func printTree(t *state.Tree) {
	byID := map[string]*state.NodeInfo{}
	images := map[string][]string{}
	for _, n := range t.Nodes {
		byID[n.ID] = n
		if n.Parent == "" {
			images[n.Image] = append(images[n.Image], n.ID)
		}
	}
	for im := range t.OnImage {
		if _, ok := images[im]; !ok {
			images[im] = nil
		}
	}
	var names []string
	for im := range images {
		names = append(names, im)
	}
	sort.Strings(names)
	var walk func(id, prefix string, last bool)
	walk = func(id, prefix string, last bool) {
		n := byID[id]
		branch, next := "├── ", "│   "
		if last {
			branch, next = "└── ", "    "
		}
		size := "no change"
		if n.Own {
			size = humanBytes(n.Bytes)
		}
		line := fmt.Sprintf("%s%s%s  %s  %s", prefix, branch, n.ID, n.Created.Local().Format(time.TimeOnly), size)
		if n.Label != "" {
			line += fmt.Sprintf("  %q", n.Label)
		}
		if !n.Durable {
			line += "  (not yet durable)"
		}
		if len(n.Sandboxes) > 0 {
			line += "  <- " + strings.Join(n.Sandboxes, ", ")
		}
		fmt.Println(line)
		for i, c := range n.Children {
			walk(c, prefix+next, i == len(n.Children)-1)
		}
	}
	if len(names) == 0 {
		fmt.Println("(no nodes and no sandboxes)")
	}
	for _, im := range names {
		line := "image " + im
		if sbs := t.OnImage[im]; len(sbs) > 0 {
			line += "  <- " + strings.Join(sbs, ", ")
		}
		fmt.Println(line)
		roots := images[im]
		for i, r := range roots {
			walk(r, "", i == len(roots)-1)
		}
	}
}
