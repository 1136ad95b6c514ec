//! A node's history as a timeline: one lane per axis (provision state, maintenance, cordoned,
//! power, connectivity), per condition and per `noScheduleReasons` entry, each a row of
//! segments (the value from one change to the next) that name who or what changed it. A time
//! slider under the lanes picks a moment; the node page then shows the node as it was then
//! (`nodeAsOf`), and a click on a segment shows the node right after the change that began it.

use chrono::{DateTime, Utc};
use leptos::prelude::*;

use crate::format::timestamp;

/// One event of the node's log, as the timeline needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub id: String,
    pub event_type: String,
    pub node_version: Option<i64>,
    pub axis: Option<String>,
    pub from: Option<String>,
    pub to: Option<String>,
    pub actor: String,
    pub cause: Option<String>,
    pub at: String,
}

/// The change that began a segment.
#[derive(Clone, Debug, PartialEq)]
pub struct Changer {
    pub actor: String,
    pub cause: Option<String>,
    pub at: String,
    pub event_type: String,
    pub node_version: Option<i64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub value: String,
    pub start_ms: i64,
    pub end_ms: i64,
    /// `None` for the value the lane had before the first change shown.
    pub changed_by: Option<Changer>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Lane {
    /// `provisionState`, `condition GpuNeedsReset`, `reason cordoned`, …
    pub name: String,
    /// `axis`, `condition` or `reason`: what the values mean (for their colour).
    pub group: &'static str,
    pub segments: Vec<Segment>,
}

/// The axes with a lane of their own, in the order shown.
pub const AXES: [&str; 5] = [
    "provisionState",
    "maintenance",
    "cordoned",
    "power",
    "connectivity",
];

fn millis(at: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(at)
        .ok()
        .map(|t| t.with_timezone(&Utc).timestamp_millis())
}

/// The event's sequence number (`evt_42` → 42), to order events written in one millisecond.
fn sequence(id: &str) -> u64 {
    id.rsplit('_')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The span the timeline covers: from the oldest change shown (or `created`, if the history
/// starts there) to `now`.
pub fn span(steps: &[Step], created: &str, now_ms: i64) -> (i64, i64) {
    let oldest = steps.iter().filter_map(|s| millis(&s.at)).min();
    let created = millis(created);
    let start = match (oldest, created) {
        (Some(o), Some(c)) => o.min(c),
        (Some(o), None) => o,
        (None, Some(c)) => c,
        (None, None) => now_ms,
    };
    // At least a second wide, so a fresh node still has a track to slide along.
    (start, now_ms.max(start + 1_000))
}

struct Builder {
    name: String,
    group: &'static str,
    segments: Vec<Segment>,
}

impl Builder {
    fn change(
        &mut self,
        start: i64,
        at_ms: i64,
        value: String,
        step: &Step,
        before: Option<String>,
    ) {
        match self.segments.last_mut() {
            Some(last) => last.end_ms = at_ms,
            None => {
                if let Some(before) = before {
                    self.segments.push(Segment {
                        value: before,
                        start_ms: start,
                        end_ms: at_ms,
                        changed_by: None,
                    });
                }
            }
        }
        self.segments.push(Segment {
            value,
            start_ms: at_ms,
            end_ms: at_ms,
            changed_by: Some(Changer {
                actor: step.actor.clone(),
                cause: step.cause.clone(),
                at: step.at.clone(),
                event_type: step.event_type.clone(),
                node_version: step.node_version,
            }),
        });
    }

    fn finish(mut self, end: i64) -> Lane {
        if let Some(last) = self.segments.last_mut() {
            last.end_ms = end;
        }
        Lane {
            name: self.name,
            group: self.group,
            segments: self.segments,
        }
    }
}

/// Folds the node's events (any order) into lanes over `(start, end)`. `current` gives each
/// axis's value now, for an axis with no change shown (its lane is one segment). Absent values
/// of conditions and reasons are left out: their lanes show only where they held.
pub fn lanes(steps: &[Step], current: &[(&str, String)], (start, end): (i64, i64)) -> Vec<Lane> {
    let mut ordered: Vec<&Step> = steps.iter().filter(|s| millis(&s.at).is_some()).collect();
    ordered.sort_by_key(|s| (millis(&s.at).unwrap_or(0), sequence(&s.id)));

    let mut axes: Vec<Builder> = AXES
        .iter()
        .map(|a| Builder {
            name: (*a).to_owned(),
            group: "axis",
            segments: Vec::new(),
        })
        .collect();
    let mut keyed: Vec<Builder> = Vec::new();
    let keyed_lane = |keyed: &mut Vec<Builder>, group: &'static str, key: &str| -> usize {
        let name = format!("{group} {key}");
        if let Some(i) = keyed.iter().position(|b| b.name == name) {
            return i;
        }
        keyed.push(Builder {
            name,
            group,
            segments: Vec::new(),
        });
        keyed.len() - 1
    };

    for step in ordered {
        let at = millis(&step.at).unwrap_or(start);
        let Some(axis) = step.axis.as_deref() else {
            continue;
        };
        if let Some(i) = AXES.iter().position(|a| *a == axis) {
            // A cordon's drain bookkeeping carries no value: not a change of the axis.
            if let Some(to) = &step.to {
                axes[i].change(start, at, to.clone(), step, step.from.clone());
            }
        } else if axis == "conditions" && step.event_type == "node.condition_changed" {
            let Some((kind, status)) = step.to.as_deref().and_then(|t| t.split_once('=')) else {
                continue;
            };
            let before = step
                .from
                .as_deref()
                .and_then(|f| f.split_once('='))
                .map(|(_, s)| s.to_owned());
            let i = keyed_lane(&mut keyed, "condition", kind);
            keyed[i].change(start, at, status.to_owned(), step, before);
        } else if axis == "noScheduleReasons" {
            match (&step.from, &step.to) {
                (None, Some(key)) => {
                    let i = keyed_lane(&mut keyed, "reason", key);
                    keyed[i].change(start, at, "present".to_owned(), step, None);
                }
                (Some(key), None) => {
                    let i = keyed_lane(&mut keyed, "reason", key);
                    keyed[i].change(
                        start,
                        at,
                        "absent".to_owned(),
                        step,
                        Some("present".to_owned()),
                    );
                }
                _ => {}
            }
        }
    }

    let mut out = Vec::new();
    for builder in axes {
        if builder.segments.is_empty() {
            // No change shown: the value now held all along (power only where it changed).
            if let Some((_, value)) = current.iter().find(|(a, _)| *a == builder.name) {
                out.push(Lane {
                    name: builder.name,
                    group: "axis",
                    segments: vec![Segment {
                        value: value.clone(),
                        start_ms: start,
                        end_ms: end,
                        changed_by: None,
                    }],
                });
            }
            continue;
        }
        out.push(builder.finish(end));
    }
    for builder in keyed {
        let mut lane = builder.finish(end);
        lane.segments
            .retain(|s| !matches!(s.value.as_str(), "absent" | "false"));
        out.push(lane);
    }
    out
}

/// The colour of a value: `bad` (keeps work off or is broken), `warn`, `good` or `neutral`.
pub fn tone(lane: &Lane, value: &str) -> &'static str {
    match (lane.group, lane.name.as_str(), value) {
        ("reason", _, _) => "bad",
        ("condition", _, "true") => "bad",
        ("condition", _, _) => "warn",
        (_, "maintenance" | "cordoned", "true") => "warn",
        (_, "maintenance" | "cordoned", "false") => "good",
        (_, "connectivity", "connected") => "good",
        (_, "connectivity", "disconnected") => "warn",
        (_, "connectivity", _) => "bad",
        (_, "provisionState", "adopted" | "ready" | "deployed") => "good",
        (_, "provisionState", "failed" | "retired") => "bad",
        (_, "power", "on") => "good",
        (_, "power", "off") => "warn",
        _ => "neutral",
    }
}

/// `at` as a share of the span, in percent (clamped to it).
pub fn percent(at_ms: i64, (start, end): (i64, i64)) -> f64 {
    let width = (end - start).max(1) as f64;
    ((at_ms - start) as f64 / width * 100.0).clamp(0.0, 100.0)
}

/// The slider's range: 0 to `SLIDER_STEPS`, spread over the span.
pub const SLIDER_STEPS: i64 = 1_000;

pub fn slider_time((start, end): (i64, i64), position: i64) -> i64 {
    start + (end - start) * position.clamp(0, SLIDER_STEPS) / SLIDER_STEPS
}

pub fn slider_position((start, end): (i64, i64), at_ms: i64) -> i64 {
    let width = (end - start).max(1);
    ((at_ms - start) * SLIDER_STEPS / width).clamp(0, SLIDER_STEPS)
}

pub fn rfc3339(ms: i64) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

pub fn to_millis(at: &str) -> Option<i64> {
    millis(at)
}

/// What the past view shows: the node at a time (the slider) or at a version (a change).
#[derive(Clone, Debug, PartialEq)]
pub enum AsOf {
    At(String),
    Version(i64),
}

/// The lanes, the slider and the moment shown. `selected` is the moment of the past view, if
/// any; `on_pick` gets the moment the operator picks.
#[component]
pub fn Timeline(
    lanes: Signal<Vec<Lane>>,
    span: Signal<(i64, i64)>,
    selected: Signal<Option<i64>>,
    on_pick: Callback<AsOf>,
) -> impl IntoView {
    // Where the slider is while it is dragged (before the operator lets go).
    let dragging = RwSignal::new(None::<i64>);
    let position = move || {
        dragging.get().unwrap_or_else(|| {
            selected
                .get()
                .map_or(SLIDER_STEPS, |at| slider_position(span.get(), at))
        })
    };
    let cursor_left = move || {
        let at = slider_time(span.get(), position());
        format!("left: {:.3}%", percent(at, span.get()))
    };
    let moment = move || {
        let at = slider_time(span.get(), position());
        if dragging.get().is_none() && selected.get().is_none() {
            "now".to_owned()
        } else {
            timestamp(&rfc3339(at))
        }
    };
    view! {
        <div class="lanes" data-testid="history-lanes">
            <For
                each=move || lanes.get()
                key=|lane| format!("{:?}", lane)
                children=move |lane| {
                    let name = lane.name.clone();
                    let segments = lane.segments.clone();
                    view! {
                        <div class="lane" data-testid="lane" data-lane=name.clone()>
                            <span class="lane-name" title=name.clone()>{name.clone()}</span>
                            <div class="track">
                                {segments.into_iter().map(|s| {
                                    let sp = span.get_untracked();
                                    let left = percent(s.start_ms, sp);
                                    let width = (percent(s.end_ms, sp) - left).max(0.4);
                                    let tone = tone(&lane, &s.value);
                                    let title = match &s.changed_by {
                                        Some(c) => format!(
                                            "{}: {} — {} by {}{} at {}{}",
                                            lane.name, s.value, c.event_type, c.actor,
                                            c.cause.as_deref().map(|x| format!(" ({x})")).unwrap_or_default(),
                                            timestamp(&c.at),
                                            c.node_version.map(|v| format!(", version {v}")).unwrap_or_default(),
                                        ),
                                        None => format!("{}: {} (before the history shown)", lane.name, s.value),
                                    };
                                    let pick = s.changed_by.as_ref().map(|c| match c.node_version {
                                        Some(v) => AsOf::Version(v),
                                        None => AsOf::At(c.at.clone()),
                                    });
                                    let clickable = pick.is_some();
                                    let actor = s.changed_by.as_ref().map(|c| c.actor.clone()).unwrap_or_default();
                                    view! {
                                        <button
                                            class=format!("seg {tone}")
                                            style=format!("left: {left:.3}%; width: {width:.3}%")
                                            title=title
                                            data-testid="segment"
                                            data-value=s.value.clone()
                                            data-actor=actor
                                            disabled=!clickable
                                            on:click=move |_| if let Some(p) = pick.clone() { on_pick.run(p) }
                                        >
                                            {s.value.clone()}
                                        </button>
                                    }
                                }).collect_view()}
                                <div class="cursor" style=cursor_left></div>
                            </div>
                        </div>
                    }
                }
            />
            <div class="lane slider-lane">
                <span class="lane-name">"as of"</span>
                <input
                    type="range"
                    class="slider"
                    data-testid="time-slider"
                    data-start=move || span.get().0.to_string()
                    data-end=move || span.get().1.to_string()
                    min="0"
                    max=SLIDER_STEPS.to_string()
                    step="1"
                    prop:value=move || position().to_string()
                    on:input=move |ev| dragging.set(event_target_value(&ev).parse().ok())
                    on:change=move |ev| {
                        dragging.set(None);
                        if let Ok(p) = event_target_value(&ev).parse::<i64>() {
                            on_pick.run(AsOf::At(rfc3339(slider_time(span.get_untracked(), p))));
                        }
                    }
                />
            </div>
            <div class="lane-scale muted">
                <span>{move || timestamp(&rfc3339(span.get().0))}</span>
                <span data-testid="slider-moment">{moment}</span>
                <span>"now"</span>
            </div>
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(id: u64, at: &str, ty: &str, axis: &str, from: Option<&str>, to: Option<&str>) -> Step {
        Step {
            id: format!("evt_{id}"),
            event_type: ty.to_owned(),
            node_version: Some(id as i64),
            axis: Some(axis.to_owned()),
            from: from.map(str::to_owned),
            to: to.map(str::to_owned),
            actor: "user:ann".to_owned(),
            cause: None,
            at: at.to_owned(),
        }
    }

    #[test]
    fn changes_become_segments_per_axis_condition_and_reason() {
        let steps = vec![
            step(
                3,
                "2026-12-02T10:00:10Z",
                "node.uncordoned",
                "cordoned",
                Some("true"),
                Some("false"),
            ),
            step(
                1,
                "2026-12-02T10:00:00Z",
                "node.cordoned",
                "cordoned",
                Some("false"),
                Some("true"),
            ),
            step(
                2,
                "2026-12-02T10:00:00Z",
                "node.no_schedule_reason_added",
                "noScheduleReasons",
                None,
                Some("cordoned"),
            ),
            step(
                4,
                "2026-12-02T10:00:10Z",
                "node.no_schedule_reason_removed",
                "noScheduleReasons",
                Some("cordoned"),
                None,
            ),
            step(
                5,
                "2026-12-02T10:00:05Z",
                "node.condition_changed",
                "conditions",
                None,
                Some("GpuNeedsReset=true"),
            ),
            step(
                6,
                "2026-12-02T10:00:05Z",
                "node.cordoned",
                "cordoned",
                None,
                None,
            ),
        ];
        let start = millis("2026-12-02T09:59:50Z").expect("time");
        let end = millis("2026-12-02T10:00:20Z").expect("time");
        let current = [("connectivity", "connected".to_owned())];
        let lanes = lanes(&steps, &current, (start, end));
        let names: Vec<&str> = lanes.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "cordoned",
                "connectivity",
                "reason cordoned",
                "condition GpuNeedsReset"
            ]
        );

        let cordoned = &lanes[0];
        let values: Vec<&str> = cordoned.segments.iter().map(|s| s.value.as_str()).collect();
        assert_eq!(values, ["false", "true", "false"]);
        assert_eq!(cordoned.segments[0].start_ms, start);
        assert!(cordoned.segments[0].changed_by.is_none());
        assert_eq!(
            cordoned.segments[1]
                .changed_by
                .as_ref()
                .map(|c| c.node_version),
            Some(Some(1))
        );
        assert_eq!(cordoned.segments[2].end_ms, end);

        assert_eq!(lanes[1].segments.len(), 1);
        assert_eq!(lanes[1].segments[0].value, "connected");

        let reason = &lanes[2];
        assert_eq!(reason.segments.len(), 1, "only where it held");
        assert_eq!(
            reason.segments[0].end_ms,
            millis("2026-12-02T10:00:10Z").expect("time")
        );

        let condition = &lanes[3];
        assert_eq!(condition.segments.len(), 1);
        assert_eq!(condition.segments[0].end_ms, end);
        assert_eq!(tone(condition, "true"), "bad");
    }

    #[test]
    fn the_slider_spans_the_history() {
        let sp = (1_000, 11_000);
        assert_eq!(slider_time(sp, 0), 1_000);
        assert_eq!(slider_time(sp, SLIDER_STEPS), 11_000);
        assert_eq!(slider_position(sp, 6_000), SLIDER_STEPS / 2);
        assert_eq!(percent(6_000, sp), 50.0);
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(span(&[], "1970-01-01T00:00:01Z", 1_500), (1_000, 2_000));
    }
}
