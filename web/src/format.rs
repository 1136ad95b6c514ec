//! How times and values are written on screen.

use chrono::{DateTime, Utc};

/// `2026-12-02 15:04:05 UTC`, or the raw text if it is not RFC 3339.
pub fn timestamp(rfc3339: &str) -> String {
    DateTime::parse_from_rfc3339(rfc3339).map_or_else(
        |_| rfc3339.to_owned(),
        |t| {
            t.with_timezone(&Utc)
                .format("%Y-%m-%d %H:%M:%S UTC")
                .to_string()
        },
    )
}

/// How long ago, roughly (`42 s ago`, `3 min ago`, `5 h ago`, `2 d ago`), measured from `now`.
pub fn ago(rfc3339: &str, now: DateTime<Utc>) -> String {
    let Ok(then) = DateTime::parse_from_rfc3339(rfc3339) else {
        return String::new();
    };
    let secs = (now - then.with_timezone(&Utc)).num_seconds();
    match secs {
        s if s < 0 => "just now".to_owned(),
        s if s < 60 => format!("{s} s ago"),
        s if s < 3_600 => format!("{} min ago", s / 60),
        s if s < 86_400 => format!("{} h ago", s / 3_600),
        s => format!("{} d ago", s / 86_400),
    }
}

/// A timestamp with how long ago it was, for `since` columns.
pub fn since(rfc3339: &str) -> String {
    format!("{} ({})", timestamp(rfc3339), ago(rfc3339, Utc::now()))
}

/// A `<input type="datetime-local">` value (local wall time, no zone) as RFC 3339 in UTC,
/// using the browser's zone offset in minutes (`Date.getTimezoneOffset`, positive west).
pub fn local_input_to_rfc3339(value: &str, offset_minutes_west: i32) -> Option<String> {
    let naive = chrono::NaiveDateTime::parse_from_str(value, "%Y-%m-%dT%H:%M")
        .or_else(|_| chrono::NaiveDateTime::parse_from_str(value, "%Y-%m-%dT%H:%M:%S"))
        .ok()?;
    let utc = naive + chrono::Duration::minutes(i64::from(offset_minutes_west));
    Some(
        utc.and_utc()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_well() {
        assert_eq!(timestamp("2026-12-02T15:04:05Z"), "2026-12-02 15:04:05 UTC");
        assert_eq!(timestamp("not a time"), "not a time");
        let now = DateTime::parse_from_rfc3339("2026-12-02T16:00:00Z")
            .expect("time")
            .with_timezone(&Utc);
        let cases = [
            ("2026-12-02T15:59:30Z", "30 s ago"),
            ("2026-12-02T15:57:00Z", "3 min ago"),
            ("2026-12-02T11:00:00Z", "5 h ago"),
            ("2026-11-30T16:00:00Z", "2 d ago"),
            ("2026-12-02T16:00:09Z", "just now"),
        ];
        for (then, expected) in cases {
            assert_eq!(ago(then, now), expected, "{then}");
        }
    }

    #[test]
    fn deadline_inputs_become_utc() {
        // A browser two hours east of UTC reports an offset of -120.
        assert_eq!(
            local_input_to_rfc3339("2026-12-02T18:30", -120).as_deref(),
            Some("2026-12-02T16:30:00Z")
        );
        assert_eq!(local_input_to_rfc3339("", 0), None);
    }
}
