//! The operator's token: kept in the browser's local storage so a reload stays signed in,
//! taken from a `#token=` sign-in link (which `better-compute dev` prints) when one is opened.
//! The token rides in the URL fragment, which browsers never send to the server, and is
//! removed from the address bar as soon as it is read.

const TOKEN_KEY: &str = "better-compute.token";
const LINK_PREFIX: &str = "#token=";

fn storage() -> Option<web_sys::Storage> {
    web_sys::window()?.local_storage().ok().flatten()
}

pub fn token() -> Option<String> {
    storage()?
        .get_item(TOKEN_KEY)
        .ok()
        .flatten()
        .filter(|t| !t.is_empty())
}

pub fn store(token: &str) {
    if let Some(storage) = storage() {
        let _ = storage.set_item(TOKEN_KEY, token.trim());
    }
}

pub fn forget() {
    if let Some(storage) = storage() {
        let _ = storage.remove_item(TOKEN_KEY);
    }
}

/// The token of a sign-in link in the address bar, if there is one; the fragment is removed
/// from the address bar (and its history entry) either way.
pub fn take_link_token() -> Option<String> {
    let window = web_sys::window()?;
    let hash = window.location().hash().ok()?;
    let token = token_from_fragment(&hash)?;
    let location = window.location();
    let clean = format!(
        "{}{}",
        location.pathname().unwrap_or_default(),
        location.search().unwrap_or_default()
    );
    if let Ok(history) = window.history() {
        let _ = history.replace_state_with_url(&wasm_bindgen::JsValue::NULL, "", Some(&clean));
    }
    Some(token)
}

/// `#token=abc` → `abc`. Percent-escapes are undone, since a link may have been copied from
/// somewhere that escaped it.
pub fn token_from_fragment(fragment: &str) -> Option<String> {
    let raw = fragment.strip_prefix(LINK_PREFIX)?;
    let raw = raw.split('&').next().unwrap_or(raw);
    let decoded = js_decode(raw);
    (!decoded.trim().is_empty()).then(|| decoded.trim().to_owned())
}

#[cfg(target_arch = "wasm32")]
fn js_decode(raw: &str) -> String {
    js_sys::decode_uri_component(raw)
        .ok()
        .and_then(|s| s.as_string())
        .unwrap_or_else(|| raw.to_owned())
}

/// Natively (unit tests) JWTs never contain escapes worth undoing.
#[cfg(not(target_arch = "wasm32"))]
fn js_decode(raw: &str) -> String {
    raw.to_owned()
}

#[cfg(test)]
mod tests {
    use super::token_from_fragment;

    #[test]
    fn sign_in_links() {
        assert_eq!(
            token_from_fragment("#token=abc.def"),
            Some("abc.def".into())
        );
        assert_eq!(token_from_fragment("#token=abc&x=1"), Some("abc".into()));
        assert_eq!(token_from_fragment("#token="), None);
        assert_eq!(token_from_fragment("#other=abc"), None);
        assert_eq!(token_from_fragment(""), None);
    }
}
