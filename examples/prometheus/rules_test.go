// Package prometheus holds the sample alerts on leasehold's metrics; its test
// keeps them valid with promtool.
package prometheus

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

type ruleFile struct {
	Groups []struct {
		Rules []struct {
			Alert string `yaml:"alert"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

type ruleTests struct {
	Tests []struct {
		Alerts []struct {
			Name string `yaml:"alertname"`
			Exp  []any  `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

func readYAML(t *testing.T, file string, into any) {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, into); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
}

// alerts are the alert names of the rules file.
func alerts(t *testing.T) []string {
	var rf ruleFile
	readYAML(t, "leasehold-rules.yml", &rf)
	var names []string
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			names = append(names, r.Alert)
		}
	}
	if len(names) == 0 {
		t.Fatal("leasehold-rules.yml: no alerts")
	}
	return names
}

// The rules pass `promtool check rules`, and `promtool test rules` passes a
// case per alert that fires it (and says when it must not fire).
func TestSampleAlertsPassPromtool(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (Debian: apt-get install prometheus): the sample " +
			"alerts are not checked")
	}
	for _, args := range [][]string{
		{"check", "rules", "leasehold-rules.yml"},
		{"test", "rules", "leasehold-rules.test.yml"},
	} {
		out, err := exec.Command(promtool, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	var rt ruleTests
	readYAML(t, "leasehold-rules.test.yml", &rt)
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range rt.Tests {
		for _, a := range tc.Alerts {
			if len(a.Exp) > 0 {
				fires[a.Name] = true
			} else {
				quiet[a.Name] = true
			}
		}
	}
	for _, name := range alerts(t) {
		if !fires[name] || !quiet[name] {
			t.Errorf("alert %s: want a test case where it fires and one where it does not "+
				"(fires %v, quiet %v)", name, fires[name], quiet[name])
		}
	}
}

// docs/metrics.md names every sample alert and the file that holds them.
func TestDocsNameEverySampleAlert(t *testing.T) {
	doc, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "examples/prometheus/leasehold-rules.yml") {
		t.Error("docs/metrics.md does not point at examples/prometheus/leasehold-rules.yml")
	}
	for _, name := range alerts(t) {
		if !strings.Contains(string(doc), "`"+name+"`") {
			t.Errorf("docs/metrics.md does not name the alert %s", name)
		}
	}
	if names := alerts(t); slices.Contains(names, "") {
		t.Errorf("an alert without a name: %v", names)
	}
}
