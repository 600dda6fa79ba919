package apitypes

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"reflect"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite testdata/golden.json from the types (a change of the API)")

// wireTypes are every request and answer type, by name.
func wireTypes() map[string]any {
	return map[string]any{
		"CheckpointRequest": &CheckpointRequest{}, "CreateOptions": &CreateOptions{},
		"ErrorBody": &ErrorBody{}, "ErrorDetail": &ErrorDetail{},
		"ExecRequest": &ExecRequest{}, "ExecResult": &ExecResult{}, "StreamEvent": &StreamEvent{},
		"FileContent": &FileContent{}, "FileInfo": &FileInfo{}, "FileListing": &FileListing{}, "MkdirResult": &MkdirResult{},
		"Image": &Image{}, "ImportEvent": &ImportEvent{}, "ImportRequest": &ImportRequest{},
		"Limits": &Limits{}, "Memory": &Memory{}, "PathCounts": &PathCounts{}, "Stats": &Stats{},
		"Sandbox": &Sandbox{}, "SandboxInfo": &SandboxInfo{}, "TemplateInfo": &TemplateInfo{}, "Usage": &Usage{},
		"Node": &Node{}, "NodeInfo": &NodeInfo{}, "OpResult": &OpResult{}, "OpMemory": &OpMemory{}, "RestoreRequest": &RestoreRequest{}, "Tree": &Tree{},
		"SessionInfo": &SessionInfo{}, "SessionOptions": &SessionOptions{},
		"SandboxList": &SandboxList{}, "SessionList": &SessionList{}, "ImageList": &ImageList{},
		"Removed": &Removed{}, "NodesRemoved": &NodesRemoved{}, "SessionKilled": &SessionKilled{},
		"Synced": &Synced{}, "Health": &Health{},
		"TemplateBudget": &TemplateBudget{}, "PinRequest": &PinRequest{},
		"SignalRequest": &SignalRequest{}, "SignalResult": &SignalResult{},
		"ForkRequest": &ForkRequest{}, "ForkResult": &ForkResult{}, "ForkBranch": &ForkBranch{}, "ForkIdentity": &ForkIdentity{}, "ForkOrigin": &ForkOrigin{}, "SandboxForkRequest": &SandboxForkRequest{},
	}
}

// fill sets every exported field of v, recursively: one element in each slice and map,
// a value behind each pointer, so that every field name (omitempty ones included)
// appears in the JSON.
func fill(v reflect.Value) {
	switch v.Kind() {
	case reflect.Struct:
		if v.Type() == reflect.TypeFor[time.Time]() {
			v.Set(reflect.ValueOf(time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)))
			return
		}
		for i := 0; i < v.NumField(); i++ {
			if v.Type().Field(i).IsExported() {
				fill(v.Field(i))
			}
		}
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fill(v.Elem())
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fill(v.Index(0))
	case reflect.Map:
		v.Set(reflect.MakeMap(v.Type()))
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		fill(k)
		fill(e)
		v.SetMapIndex(k, e)
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int32, reflect.Int64:
		v.SetInt(1)
	case reflect.Uint8, reflect.Uint32, reflect.Uint64:
		v.SetUint(1)
	case reflect.Float64:
		v.SetFloat(1.5)
	default:
		panic("fill: no value for a " + v.Type().String() + "; teach fill about it")
	}
}

// TestGolden marshals each type zero (which omitempty fields disappear) and fully
// populated (every field name) and compares with testdata/golden.json: the JSON the
// Python client and docs/API.md rely on. After an intended change of the API, run
// go test ./internal/apitypes -run Golden -update and update docs/API.md and
// clients/python with it.
func TestGolden(t *testing.T) {
	out := map[string]json.RawMessage{}
	for name, v := range wireTypes() {
		z, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		out[name+"/zero"] = z
		fill(reflect.ValueOf(v).Elem())
		f, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = f
	}
	got, err := json.MarshalIndent(out, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	const golden = "testdata/golden.json"
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(got, want) {
		return
	}
	var g, w map[string]json.RawMessage
	json.Unmarshal(got, &g)
	json.Unmarshal(want, &w)
	for k := range w {
		if _, ok := g[k]; !ok {
			t.Errorf("%s: in %s, no longer marshalled", k, golden)
		}
	}
	for k, v := range g {
		if !bytes.Equal(compact(v), compact(w[k])) {
			t.Errorf("%s changed on the wire:\n got %s\nwant %s", k, compact(v), compact(w[k]))
		}
	}
}

func compact(b []byte) []byte {
	var buf bytes.Buffer
	json.Compact(&buf, b)
	return buf.Bytes()
}
